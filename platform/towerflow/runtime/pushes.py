"""Gradient pushes from a worker: which rows of which gradient go to which shard, bucket by bucket.

The tower graph hands each bucket's averaged gradients over as soon as backprop has produced them
(`TowerStep.push_in_buckets`); `PushPlan.send` then pushes the bucket's pieces to their shards at
once, so the shards receive, average and apply the layers nearest the loss while the worker still
computes the gradients of the layers below (wait-free backpropagation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

Placement = list[list[tuple[int, int, int, bool]]]  # per shard: (variable, start row, stop row, whole?)


@dataclass
class PushPlan:
    shards: list[Any]
    placement: Placement
    buckets: list[list[int]]  # per shard, per piece: the bucket its gradient is pushed in

    def __post_init__(self) -> None:
        # Per shard, the bucket whose push completes its step: that reply carries the next version.
        self.last_buckets = [max(buckets) for buckets in self.buckets]

    @property
    def bucket_variables(self) -> list[list[int]]:
        """Per bucket, in push order, the indices of the variables whose gradients it carries."""
        found: dict[int, set[int]] = {}
        for pieces, buckets in zip(self.placement, self.buckets, strict=True):
            for (variable, *_), bucket in zip(pieces, buckets, strict=True):
                found.setdefault(bucket, set()).add(variable)
        return [sorted(found[b]) for b in sorted(found)]

    def send(
        self,
        bucket: int,
        gradients: dict[int, np.ndarray] | None,
        versions: list[int],
        pusher: tuple[int, int],
        examples: int,
        with_params: bool = True,
        number: int | None = None,
    ) -> list[tuple[int, Any]]:
        """Push `bucket` (of a gradient of `examples` examples) to every shard holding some of it;
        returns (shard, reply ref) pairs. None pushes a skipped gradient (nan_guard: skip) in the
        bucket's place. `pusher`: the worker's id and its run's incarnation (the shards' `join`).
        `with_params`: the replies carry the shards' new parameters (False: their versions only; the
        worker goes on with the parameters it has). `number`: the push's place in the worker's run,
        where several may be in flight (overlap_push): the shards take them in that order.

        Ray copies the arguments into its object store before `remote` returns, so the gradient
        buffers (which TensorFlow reuses once the hook returns) may change right after.
        """
        worker, incarnation = pusher
        sent = []
        for s, (shard, pieces, buckets) in enumerate(zip(self.shards, self.placement, self.buckets)):
            mine = [piece for piece, b in zip(pieces, buckets) if b == bucket]
            if not mine:
                continue
            rows = None
            if gradients is not None:
                rows = [
                    gradients[variable] if whole else gradients[variable][start:stop]
                    for variable, start, stop, whole in mine
                ]
            reply = shard.push.remote(
                rows, versions[s], worker, bucket, examples, with_params, incarnation, number
            )
            sent.append((s, reply))
        return sent


@dataclass
class StepPushes:
    """What one training step pushed, filled in from the tower graph's push hooks."""

    versions: list[int]  # per shard, the version the gradients were computed against
    examples: int = 0  # in the batch the gradients are of
    fetch: bool = True  # the replies are to carry new parameters (async fetch_every: not every step)
    number: int | None = None  # its place in the worker's run, where pushes overlap (overlap_push)
    sent: list[tuple[int, int, Any]] = field(default_factory=list)  # (shard, bucket, reply ref)
    nonfinite: bool = False  # the loss was NaN or infinite: nothing was pushed
    error: BaseException | None = None  # raised by a hook; re-raised by the worker after the step

    @property
    def global_step(self) -> int:
        """The step this gradient is meant for."""
        return self.versions[0] + 1
