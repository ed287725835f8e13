"""The supervision interface: TensorFlow's SessionRunHook lifecycle, run by the driver (the chief).

The driver never runs a step itself; it hears of steps from the workers and calls each hook, in
order, for every global step it learns of. One object per concern (progress, tracking,
checkpoints, stop conditions) composes the supervision story.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from towerflow.errors import TrainingError

log = logging.getLogger(__name__)


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
    start_step: int = 0  # the restored global step on resume, else 0
    resumed_from: str | None = None  # on resume: what the run goes on from ("its live shards", ...)
    # The global step at which the training data runs out, where the files' example counts tell (at
    # most: dropped stale gradients and skipped records end it sooner); None where they do not.
    data_steps: int | None = None
    last_step: int | None = None  # a hook may bound the run (StopAtStep); the shards stop there exactly
    snapshot_every: int | None = None  # shards keep their state every N steps for a checkpoint hook
    runtime: Any = None  # TrainingRuntime: what hooks may ask of the running cluster
    _metric_listeners: list[Any] = field(default_factory=list, repr=False)

    @property
    def final_step(self) -> int | None:
        """The global step the shards stop at, where known: training.max_steps or a hook's last_step."""
        bounds = [b for b in (self.spec.training.max_steps, self.last_step) if b is not None]
        return min(bounds) if bounds else None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Hand metrics that are not step figures (evaluation, counters) to every hook's on_metrics."""
        for listener in self._metric_listeners:
            listener.on_metrics(metrics, step)


@dataclass(frozen=True)
class SavedCheckpoint:
    """What `TrainingRuntime.save_checkpoint` did."""

    step: int
    written: bool  # False: skipped (already saved) or refused (nonfinite)
    nonfinite: bool = False  # the state held NaN/inf: a checkpoint is never written from it


class TrainingRuntime(Protocol):
    """The cluster as hooks see it (the driver implements it)."""

    def save_checkpoint(
        self,
        store: Any,
        version: int | None = None,
        data_position: dict[str, Any] | None = None,
        skip: Collection[int] = (),
    ) -> SavedCheckpoint:
        """Write a checkpoint of all shards at one version into `store` (checkpoint/stores.py): at
        `version` when they kept it (a multiple of `snapshot_every`), else at their next common
        version (or the final one). Each shard writes its own part; nothing is written when that
        version is in `skip` or holds NaN/inf."""

    def capture_state(self, version: int | None = None, data_position: dict[str, Any] | None = None) -> Any:
        """A consistent TrainingState of all shards: at `version` when they kept it (a multiple of
        `snapshot_every`), else at their next common version (or the final one)."""

    def profiles(self, workers: list[int]) -> dict[int, dict[str, Any] | None]:
        """Each chosen worker's profiler trace: {'files': {path: bytes}, 'window': (start, end)}."""


@dataclass
class StepEvent:
    """One global step (one applied update) as the driver heard of it."""

    global_step: int
    loss: float
    metrics: dict[str, float]
    examples: int  # examples that went into this update
    examples_seen: int  # since the start of the run
    elapsed_s: float  # wall time since training started
    examples_per_sec: float | None  # over a sliding window of recent steps; None until two have ended
    time_split: dict[str, float]  # mean seconds per phase: pull, compute, push, apply
    workers: list[int]  # workers whose gradients made up this update
    dropped_stale: int = 0  # gradients dropped since the previous event
    staleness: list[int] = field(default_factory=list)  # of each gradient applied (async)
    nonfinite: bool = False  # a worker's loss was NaN/inf: it stopped without pushing (nothing applied)


@dataclass
class FaultEvent:
    """A training actor lost, and what the controller did about it."""

    global_step: int
    what: str  # e.g. "worker 1 lost at step 57: the actor died ..."
    action: str  # "replaced", "rolled back to step 50", "failed the run"


@dataclass
class RunOutcome:
    # TAKEN_OVER: another driver has the run now (errors.RunTakenOver); this one's hooks leave the
    # run as it is: no status, no artifact, nothing read from its actors (the new driver's now)
    status: Literal["FINISHED", "FAILED", "KILLED", "TAKEN_OVER"]
    global_step: int
    error: BaseException | None = None
    result: Any = None  # the TrainResult when the run finished normally
    # KILLED by a stop signal (SIGTERM, Ctrl-C) after the steps in flight ended: the shards hold
    # the final state, which a hook may still read (the checkpoint hook saves it).
    stopped_between_steps: bool = False

    @property
    def taken_over(self) -> bool:
        return self.status == "TAKEN_OVER"


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
        """Always called once, also when training failed (outcome.status says how it ended; where
        another driver took the run over, `outcome.taken_over`, leave the run as it is).

        Hooks end in reverse order of their begin, so the first hook (the tracker) ends last and
        sees what the others did at the end (final checkpoint, final evaluation)."""

    def on_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Metrics another hook computed (evaluation, ...) at global step `step`."""

    def on_fault(self, event: FaultEvent) -> None:
        """A worker or parameter server was lost, or a node holding a shard is about to go (it
        drains); the controller has acted (event.action says how)."""

    def on_past_steps(self, events: list[StepEvent]) -> None:
        """Steps that no driver reported, heard of later: a lost driver's last ones, from the workers
        a new driver took over (runtime/run_keeper.py), in step order, right after `begin`. For the
        record only: the run is past them (their elapsed_s is not known)."""


def end_hooks(begun: list[Hook], session: SessionInfo, outcome: RunOutcome) -> BaseException | None:
    """End every begun hook, last begun first, even when some fail or are interrupted.

    A hook that fails at the end of a finished run (an export, say) fails the run: the hooks
    still to end (the tracker last) see FAILED, and the error is returned to raise. After a
    failed run the first error stays the one reported; later ones are only printed. A second
    stop signal interrupts the hook ending then (a final checkpoint, say); the others still end,
    the tracker marks the run KILLED.
    """
    failure: BaseException | None = None
    for hook in reversed(begun):
        try:
            hook.end(session, outcome)
        except KeyboardInterrupt as exc:  # the hooks still to end see KILLED, and save nothing more
            log.warning("hook %s.end interrupted", type(hook).__name__)
            if outcome.status == "FINISHED":
                failure = exc  # raised once every hook has ended
            if outcome.status not in ("FAILED", "TAKEN_OVER"):
                outcome = RunOutcome("KILLED", outcome.global_step, exc)
        except Exception as exc:
            name = type(hook).__name__
            if outcome.status != "FINISHED":
                log.warning("hook %s.end failed after the run had failed: %s", name, exc)
                continue
            failure = TrainingError(
                f"the run trained to step {outcome.global_step}, then hook {name} failed at its end: {exc}"
            )
            failure.__cause__ = exc
            outcome = RunOutcome("FAILED", outcome.global_step, failure)
    return failure
