"""What a tower worker and the driver tell each other: the record of each gradient, a
replacement's start, the report at each poll and what a spare traces its step for.

Apart from the worker's actor so that the driver's side (events, recovery) reads them without
loading the worker's module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from towerflow.runtime.protocol import Verdict

if TYPE_CHECKING:
    from towerflow.runtime.pushes import StepPushes


@dataclass
class StepRecord:
    """One gradient a worker computed and what became of it."""

    worker: int
    step: int  # global step it went into, -1 if dropped
    verdict: Verdict  # APPLIED, STALE, REJECTED, SKIPPED, DONE (the shards'), PARTIAL or NONFINITE
    version_read: int
    loss: float
    metrics: dict[str, float]
    examples: int
    staleness: int
    time_split: dict[str, float] = field(default_factory=dict)  # data, pull, compute, push, apply
    finished_at: float = 0.0
    workers: tuple[int, ...] = ()  # whose gradients the step applied, as the lead shard did (): unknown

    @classmethod
    def of_step(
        cls,
        worker: int,
        step: StepPushes,
        loss: float,
        metrics: dict[str, Any],
        every: list[Any],
        completing: list[Any],
        split: dict[str, float],
    ) -> StepRecord:
        """A step the shards took, from the replies to all its pushes (`every`) and, per shard,
        the one that completed it: the verdict (PARTIAL where the buckets' differ), the worst
        staleness, and the worker's time split with the shards' slowest apply."""
        lead = completing[0]
        verdict = lead.verdict if all(r.verdict == lead.verdict for r in every) else Verdict.PARTIAL
        return cls(
            worker=worker,
            step=lead.step,
            verdict=verdict,
            version_read=step.versions[0],
            loss=loss,
            metrics={k: float(v) for k, v in metrics.items()},
            examples=step.examples,
            staleness=max(r.staleness for r in every),
            time_split={**split, "apply": max(r.apply_s for r in completing)},
            finished_at=time.time(),
            workers=lead.workers,
        )

    @classmethod
    def nonfinite(cls, worker: int, version_read: int, loss: float, rows: int) -> StepRecord:
        """A step whose loss was NaN/inf: nothing of it was applied (its batch was used all the same)."""
        return cls(worker, -1, Verdict.NONFINITE, version_read, loss, {}, rows, 0, finished_at=time.time())


@dataclass
class Rejoin:
    """What a replacement worker needs beyond its config: its lost predecessor's unused rows
    (data/splits.Leftover pieces), and the model's non-trainable state as the others hold it."""

    leftover: list[Any] = field(default_factory=list)
    model_state: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class WorkerReport:
    """What a worker tells the controller at each poll: its new step records, for how long it
    has been working on its current step (None while it waits for the shards or has not stepped
    yet: a worker busy for longer than the timeout is hung), and for how long it has been waiting
    for its next batch (None when not waiting: a run whose workers all wait too long is stalled),
    and the term of the driver it takes its orders from (runtime/fencing.py)."""

    records: list[StepRecord]
    busy_s: float | None
    data_wait_s: float | None = None
    term: int = 0


@dataclass(frozen=True)
class WarmUp:
    """A member's batch, as a spare traces its step ahead: types and shapes, and the towers' own
    preprocessing (the model the step calls)."""

    signature: tuple[Any, Any]
    tower_preprocess: list[str]
