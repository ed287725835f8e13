"""CheckpointSaver: save the whole training state every N steps or N seconds, and at the end.

TensorFlow's defaults: every 600 s when no interval is given, keep the newest 5, optionally one
every n hours for good. A state that holds a NaN/inf is never saved, so the newest checkpoint is
always a good one to resume from. A run stopped by SIGTERM or Ctrl-C saves its final state too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from towerflow.checkpoint.retention import checkpoints_to_delete
from towerflow.checkpoint.stores import CheckpointStore
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
        self._last_step = 0
        self._last_time = 0.0
        self._started_at = time.time()

    def begin(self, session: SessionInfo) -> None:
        factory = self._store_or_factory
        self.store = factory(session) if callable(factory) else factory
        self._last_step = session.start_step
        self._last_time = time.monotonic()
        self._started_at = time.time()
        session.snapshot_every = self.every_steps  # the shards keep exactly those steps for us

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        if event.nonfinite:
            return
        every = self.every_steps
        if every is not None and event.global_step // every > self._last_step // every:
            step = event.global_step // every * every
            self.save(context.session, step, {"examples_seen": event.examples_seen, "global_step": step})
        elif self.every_secs is not None and time.monotonic() - self._last_time >= self.every_secs:
            self.save(context.session)

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
        for step in checkpoints_to_delete(
            self.store.list(), self.max_to_keep, self.keep_every_n_hours, started_at=self._started_at
        ):
            self.store.delete(step)
        session.log_metrics({"checkpoint_step": float(saved.step)}, saved.step)
        return saved.step
