"""CheckpointSaver: save the whole training state every N steps or N seconds, and at the end.

TensorFlow's defaults: every 600 s when no interval is given, keep the newest 5, optionally one
every n hours for good. A state that holds a NaN/inf is never saved, so the newest checkpoint is
always a good one to resume from. A run stopped by SIGTERM or Ctrl-C saves its final state too.
A checkpoint due while the store is away (a tracking server that does not answer) is skipped with
a warning and training goes on; the next one due is tried as usual. The final one is not skipped:
a run that cannot save it fails, and a resume continues from the newest one written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from towerflow.checkpoint.retention import checkpoints_to_delete
from towerflow.checkpoint.stores import CheckpointStore, StoreUnavailable
from towerflow.runtime.hooks import Hook, RunContext, RunOutcome, SessionInfo, StepEvent

log = logging.getLogger(__name__)


class CheckpointSaverHook(Hook):
    def __init__(
        self,
        store: CheckpointStore | Callable[[SessionInfo], CheckpointStore],
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
        max_to_keep: int = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        at_end: bool = True,
    ) -> None:
        if every_steps is None and every_secs is None:
            every_secs = 600.0
        self._store_or_factory = store
        self.store: CheckpointStore | None = None
        self.every_steps = every_steps
        self.every_secs = every_secs
        self.max_to_keep = max_to_keep
        self.keep_every_n_hours = keep_checkpoint_every_n_hours
        self.at_end = at_end
        self.saved: list[int] = []
        self.skipped_nonfinite: list[int] = []
        self.skipped_unavailable: list[int] = []  # due while the store was away
        self._last_step = 0
        self._last_time = 0.0
        self._started_at = time.time()

    def begin(self, session: SessionInfo) -> None:
        factory = self._store_or_factory
        self.store = factory(session) if callable(factory) else factory
        steps = self._steps_stored() if session.start_step or self.keep_every_n_hours is not None else []
        self._kept_for_good = self._kept_by_earlier_drivers(steps)
        if session.start_step in steps:
            # A resume at a stored step (a run whose end failed after its last checkpoint, say):
            # that checkpoint stays as written, not saved over by this driver's end.
            self.saved.append(session.start_step)
        self._last_step = session.start_step
        self._last_time = time.monotonic()
        self._started_at = time.time()
        session.snapshot_every = self.every_steps  # the shards keep exactly those steps for us

    def _steps_stored(self) -> list[int]:
        """The run's complete checkpoints' steps, oldest first; none where the store is away."""
        try:
            return sorted(step for step, _ in self.store.list())
        except Exception as exc:  # the store away: judged as this driver's own, as before
            log.warning("could not list the run's checkpoints (%s): this driver judges them all its own", exc)
            return []

    def _kept_by_earlier_drivers(self, steps: list[int]) -> frozenset[int]:
        """A resumed run's checkpoints older than its newest `max_to_keep`: with
        `keep_checkpoint_every_n_hours`, those its earlier drivers kept for good (the rest they
        deleted)."""
        if self.keep_every_n_hours is None:
            return frozenset()
        return frozenset(steps[: -self.max_to_keep] if self.max_to_keep else steps)

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        if event.nonfinite:
            return
        every = self.every_steps
        if every is not None and event.global_step // every > self._last_step // every:
            step = event.global_step // every * every
            position = {"examples_seen": event.examples_seen, "global_step": step}
            self._save_or_skip(context.session, step, step, position)
        elif self.every_secs is not None and time.monotonic() - self._last_time >= self.every_secs:
            self._save_or_skip(context.session, event.global_step)

    def _save_or_skip(
        self, session: SessionInfo, due: int, step: int | None = None, position: dict | None = None
    ) -> None:
        """`save`; where the store is away, skip the checkpoint due at step `due` and train on."""
        try:
            self.save(session, step, position)
        except StoreUnavailable as exc:
            self._last_step, self._last_time = due, time.monotonic()
            self.skipped_unavailable.append(due)
            log.warning("checkpoint skipped, training goes on: %s", exc)

    def end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        if not self.at_end or session.runtime is None:
            return
        if outcome.status == "FINISHED":
            self.save(session)
        elif outcome.stopped_between_steps and outcome.global_step > self._last_step:
            # SIGTERM (a preempted pod, `ray job stop`) or Ctrl-C: keep the steps since the last
            # checkpoint, as TensorFlow's PreemptionCheckpointHandler does. A checkpoint cut short
            # by a SIGKILL is never listed, so the newest complete one stays the one to resume from.
            saved = self.save(session)
            if saved is not None:
                log.warning("saved a checkpoint of step %d before stopping", saved)

    def save(self, session: SessionInfo, step: int | None = None, position: dict | None = None) -> int | None:
        """Save the state at `step` (one the shards kept), or at their next version. The shards
        write their own parts (the driver never holds the model's state)."""
        saved = session.runtime.save_checkpoint(self.store, step, position, skip=self.saved)
        self._last_step, self._last_time = saved.step, time.monotonic()
        if saved.nonfinite:
            self.skipped_nonfinite.append(saved.step)
            log.warning("not saving step %d: the parameters hold NaN/inf", saved.step)
            return None
        if not saved.written:  # this step is saved already
            return saved.step
        self.saved.append(saved.step)
        try:
            for step in checkpoints_to_delete(
                self.store.list(),
                self.max_to_keep,
                self.keep_every_n_hours,
                started_at=self._started_at,
                kept_for_good=self._kept_for_good,
            ):
                self.store.delete(step)
            if unfinished := self.store.prune_unfinished(before=saved.step):
                log.info("removed the parts of checkpoints never finished, of steps %s", unfinished)
        except Exception as exc:  # housekeeping: the next save prunes again
            log.warning("old checkpoints not pruned after step %d: %s", saved.step, exc)
        session.log_metrics({"checkpoint_step": float(saved.step)}, saved.step)
        return saved.step
