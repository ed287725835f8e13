"""Eval: every N global steps, evaluate the current parameters on the eval split, off the hot path.

An evaluator actor (TensorFlow's evaluator task) pulls the shards' parameters itself and streams
the eval files; training goes on meanwhile. At most one evaluation is in flight: when it is due
again before the last one returned, it waits for the next due step. An evaluation due at the last
step is left to the end's, which the runtime runs on an idle worker where no evaluator was started.
Results are logged as `eval_<metric>` at the global step that was evaluated.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from towerflow.runtime.hooks import Hook, RunContext, RunOutcome, SessionInfo, StepEvent


class EvalHook(Hook):
    def __init__(
        self,
        every_steps: int,
        metrics: list[str],
        *,
        batch_size: int,
        max_batches: int | None = None,
        at_end: bool = True,
    ) -> None:
        self.every_steps = every_steps
        self.metrics = list(metrics)
        self.batch_size = batch_size
        self.max_batches = max_batches
        self.at_end = at_end
        self.results: list[tuple[int, dict[str, float]]] = []
        self._source: Any = None
        self._last_step = 0
        self._in_flight: Future | None = None

    def begin(self, session: SessionInfo) -> None:
        from towerflow.data.eval_reader import eval_source

        self._source = eval_source(session.spec)
        self._last_step = session.start_step

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        self._collect(context.session, wait=False)
        final = context.session.final_step
        if self.at_end and final is not None and event.global_step >= final:
            return  # due at the last step: the end's evaluation takes it, once the workers are idle
        if event.global_step - self._last_step >= self.every_steps:
            self._last_step = event.global_step  # one still running: this one is left out
            if self._in_flight is None:
                self._in_flight = self._start(context.session)

    def end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        if session.runtime is None or outcome.status != "FINISHED":
            return
        self._collect(session, wait=True)
        if self.at_end and (not self.results or self.results[-1][0] < outcome.global_step):
            self._in_flight = self._start(session)
            self._collect(session, wait=True)

    def _start(self, session: SessionInfo) -> Future:
        return session.runtime.evaluate(self._source, self.metrics, self.batch_size, self.max_batches)

    def _collect(self, session: SessionInfo, *, wait: bool) -> None:
        if self._in_flight is None or not (wait or self._in_flight.done()):
            return
        future, self._in_flight = self._in_flight, None
        version, values = future.result()
        self.results.append((version, values))
        session.log_metrics({f"eval_{k}": v for k, v in values.items()}, version)
