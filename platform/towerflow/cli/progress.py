"""Live progress for `towerflow train`: a rich bar on a terminal, periodic timed lines in job logs."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from towerflow.messages import stamp
from towerflow.runtime.hooks import Hook, RunContext, RunOutcome, SessionInfo, StepEvent


class ProgressHook(Hook):
    """Shows global step, loss and examples/sec as the driver hears of steps."""

    def __init__(self, total_steps: int | None, *, console: Console | None = None, log_every_s: float = 10.0):
        self.console = console or Console(stderr=True)
        self.log_every_s = log_every_s
        self._progress: Progress | None = None
        self._task = None
        self._last_log = 0.0
        self._max_steps = total_steps
        self._session: SessionInfo | None = None

    def after_create_session(self, session: SessionInfo) -> None:
        shape = f"{session.num_workers} workers x {session.spec.cluster.towers_per_worker} towers, {session.num_shards} PS"
        self.console.print(f"[bold]towerflow[/]: {session.spec.name} ({session.spec.training.mode}, {shape})")
        self._session = session
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} ex/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=self.total, loss="-", rate="-")
            self._progress.start()

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        loss = f"{event.loss:.4f}"
        rate = "-" if event.examples_per_sec is None else f"{event.examples_per_sec:,.0f}"
        total = self.total  # a rollback or a resize re-plans the data, and its end
        if self._progress is not None:
            self._progress.update(self._task, total=total, completed=event.global_step, loss=loss, rate=rate)
        elif time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            print(
                f"{stamp()} step {event.global_step}{f'/{total}' if total else ''} loss {loss} "
                f"examples/sec {rate}",
                file=sys.stderr,
                flush=True,
            )

    @property
    def total(self) -> int | None:
        """The run ends at the first of max_steps, a hook's last step (StopAtStep) and the data's end."""
        session = self._session
        found = () if session is None else (session.final_step, session.data_steps)
        bounds = [b for b in (self._max_steps, *found) if b is not None]
        return min(bounds) if bounds else None

    def end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
