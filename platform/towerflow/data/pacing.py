"""Pace Ray Data's scheduling loop so that a backpressured pipeline does not spin.

Ray Data's streaming executor (in the streaming_split coordinator) blocks in `ray.wait` only while
tasks are running unfinished. Once readahead is full, its read tasks' outputs are ready but may not
be read, so `ray.wait` returns at once and the loop spins: measured at 40-70% of a core for the
whole run on a 2-core machine, taken from the towers. This callback stretches every loop step to
at least `data.executor_step_ms`; a step that already waited or did real work is not slowed.
"""

from __future__ import annotations

import time
from typing import Any

from ray.data._internal.execution.execution_callback import ExecutionCallback

CONFIG_KEY = "towerflow.executor_step_s"


class PacedSchedulingLoop(ExecutionCallback):
    """Sleeps at the end of a scheduling-loop step that took less than the configured minimum."""

    def __init__(self) -> None:
        self._min_step_s = 0.0
        self._step_began = time.monotonic()

    def before_execution_starts(self, executor: Any) -> None:
        self._min_step_s = float(executor._data_context.get_config(CONFIG_KEY, 0.0) or 0.0)
        self._step_began = time.monotonic()

    def on_execution_step(self, executor: Any) -> None:
        if self._min_step_s > 0:
            left = self._min_step_s - (time.monotonic() - self._step_began)
            if left > 0:
                time.sleep(left)
        self._step_began = time.monotonic()


def pace_scheduling_loop(context: Any, min_step_s: float) -> None:
    """Install the pacing on this dataset's DataContext (it travels with the dataset)."""
    context.set_config(CONFIG_KEY, min_step_s)
    if PacedSchedulingLoop not in context.custom_execution_callback_classes:
        context.custom_execution_callback_classes.append(PacedSchedulingLoop)
