"""StopAtStep: end the run at a global step (absolute, or counted from where it started/resumed)."""

from __future__ import annotations

from towerflow.runtime.hooks import Hook, RunContext, SessionInfo, StepEvent


class StopAtStepHook(Hook):
    def __init__(self, num_steps: int | None = None, last_step: int | None = None) -> None:
        if (num_steps is None) == (last_step is None):
            raise ValueError("StopAtStepHook takes exactly one of num_steps and last_step")
        self.num_steps = num_steps
        self.last_step = last_step

    def begin(self, session: SessionInfo) -> None:
        if self.last_step is None:
            self.last_step = session.start_step + self.num_steps
        # The shards stop applying exactly there; the request below only ends the workers sooner.
        session.last_step = min(self.last_step, session.last_step or self.last_step)

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        if event.global_step >= self.last_step:
            context.request_stop(f"reached step {self.last_step}")
