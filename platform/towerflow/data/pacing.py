"""Pace Ray Data's scheduling loop so that a backpressured pipeline does not spin.

Ray Data's streaming executor (in the streaming_split coordinator) blocks in `ray.wait` only while
tasks are running unfinished. Once readahead is full, its read tasks' outputs are ready but may not
be read, so `ray.wait` returns at once and the loop spins: measured at 40-70% of a core for the
whole run on a 2-core machine, taken from the towers. This callback stretches every loop step to
at least `data.executor_step_ms`; a step that already waited or did real work is not slowed.

While no consumer waits for a block, a step lasts up to `QUIET_STEP_S`: each step costs Ray Data
a few ms of CPU (resource accounting, metrics, progress) even with nothing to hand over. Over a
310-step LeNet run the split coordinator's CPU went 7.9 -> 5.8 s (about 3 s of it its start). The
quiet sleep ends at the next `data.executor_step_ms` mark after a consumer starts to wait (Ray's
own starvation signal), so a worker that needs a block waits for the loop no longer than before,
and at the next mark after the execution is shut down (at a run's end or a resize), which waits
for the loop.
"""

from __future__ import annotations

import time
from typing import Any

from ray.data._internal.execution.execution_callback import ExecutionCallback

CONFIG_KEY = "towerflow.executor_step_s"
QUIET_STEP_S = 0.25  # longest step while every consumer has what it asked for


def consumers_waiting(executor: Any) -> bool:
    """Whether a consumer of this execution is blocked waiting for its next block (True where the
    executor's shape is not the one known: then the loop keeps the minimum pace)."""
    output_node = getattr(executor, "_output_node", None)
    waiting = getattr(output_node[1], "num_waiting_consumers", 1) if output_node else 1
    return waiting > 0


def shutting_down(executor: Any) -> bool:
    """Whether the execution is being shut down: its `shutdown` waits for the loop to end."""
    return bool(getattr(executor, "_shutdown", False))


class PacedSchedulingLoop(ExecutionCallback):
    """Sleeps at the end of a scheduling-loop step that took less than the configured minimum, and
    on to `QUIET_STEP_S` while no consumer waits and no shutdown has begun."""

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
            quiet_until = self._step_began + QUIET_STEP_S
            while not (consumers_waiting(executor) or shutting_down(executor)):
                left = quiet_until - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(self._min_step_s, left))  # looks again each pace
        self._step_began = time.monotonic()


def pace_scheduling_loop(context: Any, min_step_s: float) -> None:
    """Install the pacing on this dataset's DataContext (it travels with the dataset)."""
    context.set_config(CONFIG_KEY, min_step_s)
    if PacedSchedulingLoop not in context.custom_execution_callback_classes:
        context.custom_execution_callback_classes.append(PacedSchedulingLoop)
