"""The supervision interface: TensorFlow's SessionRunHook lifecycle, run by the driver (the chief).

The driver never runs a step itself; it hears of steps from the workers and calls each hook, in
order, for every global step it learns of. One object per concern (progress, tracking,
checkpoints, stop conditions) composes the supervision story.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class SessionInfo:
    """What hooks may know about the job: its spec, the cluster shape, the variables and shards."""

    spec: Any  # towerflow.spec.JobSpec; typed loosely so the runtime stays free of spec imports here
    num_workers: int
    num_shards: int
    variables: list[Any] = field(default_factory=list)  # list[VariableInfo], in model order
    pieces: list[Any] = field(default_factory=list)  # list[Piece]: variables or row slices of them
    shard_assignment: list[list[int]] = field(default_factory=list)  # piece indices per shard
    tags: dict[str, str] = field(default_factory=dict)  # filled by hooks (e.g. the tracking run id)


@dataclass
class StepEvent:
    """One global step (one applied update) as the driver heard of it."""

    global_step: int
    loss: float
    metrics: dict[str, float]
    examples: int  # examples that went into this update
    examples_seen: int  # since the start of the run
    elapsed_s: float  # wall time since training started
    examples_per_sec: float  # over a sliding window of recent steps
    time_split: dict[str, float]  # mean seconds per phase: pull, compute, push, apply
    workers: list[int]  # workers whose gradients made up this update
    dropped_stale: int = 0  # gradients dropped since the previous event
    staleness: list[int] = field(default_factory=list)  # of each gradient applied (async)


@dataclass
class RunOutcome:
    status: Literal["FINISHED", "FAILED", "KILLED"]
    global_step: int
    error: BaseException | None = None
    result: Any = None  # the TrainResult of a FINISHED run (trained parameters included), else None


class RunContext:
    """Passed to before_run/after_run; a hook asks the whole job to stop through it."""

    def __init__(self, session: SessionInfo) -> None:
        self.session = session
        self.stop_requested = False
        self.stop_reason: str | None = None

    def request_stop(self, reason: str = "requested by a hook") -> None:
        self.stop_requested = True
        self.stop_reason = self.stop_reason or reason


class Hook:
    """Base class with TensorFlow's five methods; override those a concern needs."""

    def begin(self, session: SessionInfo) -> None:
        """Before any actor exists."""

    def after_create_session(self, session: SessionInfo) -> None:
        """Actors are up and the shards hold the initial parameters."""

    def before_run(self, context: RunContext, global_step: int) -> None:
        """Before the driver reports `global_step`."""

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        """After an update was applied."""

    def end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        """Always called once, also when training failed (outcome.status says how it ended)."""
