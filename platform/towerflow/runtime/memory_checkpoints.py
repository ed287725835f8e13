"""Memory checkpoints (`training.failure.memory_checkpoint_every_s`): every few seconds, a cut of
every shard at one version that the shards keep in memory, each shard its own state and another
actor a copy of it (runtime/held_copies.py): another shard (on another node wherever the placement
allows), or, where the run has one shard, its first warm spare shard, else one of its workers (on
another node where one is). A lost shard then rolls the shards back to that version, the shard in
its place loading the copy its holder kept (a spare that takes the place loads its own), rather
than to the last stored checkpoint: seconds of steps to redo instead of up to a checkpoint
interval's.

One is begun on one turn of the controller and committed on a later one, once every shard holds its
part: neither the training nor the controller's loop waits for it. Only a stored checkpoint outlives
the run's shards: a resume, or a rollback after a shard and the peer holding its copy were lost
together, goes back to the stored one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryCheckpoint:
    """A committed memory checkpoint; read as a stored checkpoint is by a rollback."""

    global_step: int
    examples_seen: int  # the data position heard of when it was begun: a little early, never late
    holders: tuple[Any, ...]  # per shard, the actor holding a copy of its part: a shard, a spare, a worker
    model_state: dict[str, np.ndarray] = field(default_factory=dict)

    def holder(self, shard: int) -> Any:
        """The actor that holds a copy of `shard`'s part."""
        return self.holders[shard]

    def restores(self, lost: Collection[int], lives: Callable[[Any], bool]) -> bool:
        """Whether every lost shard's part can be had from its holder (`lives`: whether an actor
        is alive and not among the lost)."""
        return all(lives(self.holder(shard)) for shard in lost)


def peer_ring(nodes: Sequence[Any]) -> list[int]:
    """Per shard, the shard to hold a copy of its part: a ring through every shard in which each
    one's successor is on another node wherever the layout allows (`nodes`: each shard's node,
    None where unknown). The shards of the most crowded node go first, between the others'."""
    left = {node: [shard for shard, n in enumerate(nodes) if n == node] for node in dict.fromkeys(nodes)}
    order: list[int] = []
    last: Any = object()
    while len(order) < len(nodes):
        candidates = [n for n in left if left[n] and n != last] or [n for n in left if left[n]]
        last = max(candidates, key=lambda n: len(left[n]))
        order.append(left[last].pop(0))
    after = {shard: order[(k + 1) % len(order)] for k, shard in enumerate(order)}
    return [after[shard] for shard in range(len(nodes))]


@dataclass
class _Begun:
    version: int
    examples_seen: int
    holders: tuple[int, ...]
    refs: list[Any]  # per shard, the version it kept (`ParameterShard.copy_to_peer`)
    model_state_refs: list[Any]  # the workers' answers with their non-trainable state


class MemoryCheckpoints:
    """When memory checkpoints are due, and the newest one committed."""

    def __init__(
        self,
        every_s: float | None,
        draining_every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = every_s
        self.draining_every_s = draining_every_s  # while a node holding a shard drains (draining.py)
        self.draining = False
        self.latest: MemoryCheckpoint | None = None
        self._clock = clock
        self._begun: _Begun | None = None
        self._last_begun_at = clock()  # the first one falls due every_s into the run

    def due(self) -> bool:
        """One is due: none under way, and `every_s` since the last was begun (`draining_every_s`
        while `draining`, where set)."""
        every_s = self.draining_every_s if self.draining and self.draining_every_s else self.every_s
        if every_s is None or self._begun is not None:
            return False
        return self._clock() - self._last_begun_at >= every_s

    def begin(
        self,
        shards: list[Any],
        version: int,
        examples_seen: int,
        holders: Sequence[Any],
        model_state_refs: list[Any],
    ) -> None:
        """Every shard keeps its state at `version` and copies it to its holder (an actor: another
        shard, `peer_ring`, a spare or a worker); the workers' non-trainable state, asked for
        meanwhile, goes with it."""
        refs = [shard.copy_to_peer.remote(version, holders[i]) for i, shard in enumerate(shards)]
        self._begun = _Begun(version, examples_seen, tuple(holders), refs, model_state_refs)
        self._last_begun_at = self._clock()

    def ready(self) -> int | None:
        """The version of the one begun, once every shard holds its part; None while it is under
        way, or where it failed (a shard lost or finished before the version: the loss is the
        controller's to find), in which case it is given up and the next one falls due as usual."""
        begun = self._begun
        if begun is None:
            return None
        waited = begun.refs + begun.model_state_refs  # a hung worker's answer: once it is replaced
        done, _ = ray.wait(waited, num_returns=len(waited), timeout=0)
        if len(done) < len(waited):
            return None
        try:
            kept = ray.get(begun.refs)
        except ray.exceptions.RayError as exc:
            log.debug("memory checkpoint at step %d given up: %s", begun.version, exc)
            kept = None
        if kept is None or any(version != begun.version for version in kept):
            self._begun = None
            return None
        return begun.version

    def commit(self, averaged: Callable[[list[Any]], dict[str, np.ndarray]]) -> MemoryCheckpoint:
        """The one begun is whole (`ready` said so): it is the newest a rollback may go back to, with
        the workers' state `averaged` from their answers."""
        begun, self._begun = self._begun, None
        assert begun is not None, "commit without a ready memory checkpoint"
        model_state = averaged(begun.model_state_refs)
        self.latest = MemoryCheckpoint(begun.version, begun.examples_seen, begun.holders, model_state)
        log.debug("memory checkpoint at step %d", begun.version)
        return self.latest

    def forget(self) -> None:
        """The shards are rolled back: what they kept belongs to the timeline left behind."""
        self.latest = self._begun = None
