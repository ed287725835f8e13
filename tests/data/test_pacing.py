"""The paced scheduling loop on a real Ray Data execution: no step is shorter than asked."""

from __future__ import annotations

import time

from ray.data._internal.execution.execution_callback import ExecutionCallback

from towerflow.data.pacing import PacedSchedulingLoop, pace_scheduling_loop


class CountSteps(ExecutionCallback):
    steps = 0

    def on_execution_step(self, executor) -> None:
        CountSteps.steps += 1


def _consume_slowly(ray, min_step_s: float) -> tuple[int, float]:
    ds = ray.data.range(400, override_num_blocks=20).map_batches(lambda b: b, batch_size=20)
    pace_scheduling_loop(ds.context, min_step_s)
    ds.context.custom_execution_callback_classes.append(CountSteps)
    CountSteps.steps = 0
    started = time.monotonic()
    for _ in ds.iter_batches(batch_size=20):
        time.sleep(0.05)  # a slow consumer: the executor is backpressured or idle most of the time
    return CountSteps.steps, time.monotonic() - started


def test_the_loop_steps_no_faster_than_the_minimum(ray_cluster):
    steps, seconds = _consume_slowly(ray_cluster, 0.1)
    assert steps > 0
    assert steps <= seconds / 0.1 + 2  # each step lasted at least 100 ms


def test_pacing_is_installed_once_and_travels_with_the_dataset(ray_cluster):
    ds = ray_cluster.data.range(10)
    pace_scheduling_loop(ds.context, 0.02)
    pace_scheduling_loop(ds.context, 0.03)
    assert ds.context.custom_execution_callback_classes.count(PacedSchedulingLoop) == 1
    assert ds.context.get_config("towerflow.executor_step_s") == 0.03
