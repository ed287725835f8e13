"""The paced scheduling loop on a real Ray Data execution: no step is shorter than asked, and a
step lasts on to the quiet pace only while no consumer waits for a block."""

from __future__ import annotations

import statistics
import threading
import time

from ray.data import ExecutionResources
from ray.data._internal.execution.execution_callback import ExecutionCallback

from towerflow.data.pacing import QUIET_STEP_S, PacedSchedulingLoop, consumers_waiting, pace_scheduling_loop


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


def _backpressured(ray, callback: type[ExecutionCallback]):
    """8 blocks of 2 MB behind a 5 MB budget, paced at 20 ms: the execution stays backpressured
    while its consumer is slow; `callback` installed after the pacing."""
    ds = ray.data.range_tensor(8000, shape=(256,), override_num_blocks=8)
    ds = ds.map_batches(lambda b: b, batch_size=None)
    ds.context.execution_options.resource_limits = ExecutionResources(object_store_memory=5_000_000)
    pace_scheduling_loop(ds.context, 0.02)
    ds.context.custom_execution_callback_classes.append(callback)
    return ds


class RecordSteps(ExecutionCallback):
    """The execution's executor; when each step ended (after the pacing: it is installed first) and
    whether a consumer waited."""

    executor = None
    steps: list[tuple[float, bool]] = []

    def before_execution_starts(self, executor) -> None:
        RecordSteps.executor = executor

    def on_execution_step(self, executor) -> None:
        RecordSteps.steps.append((time.monotonic(), consumers_waiting(executor)))


def test_a_step_lasts_to_the_quiet_pace_unless_a_consumer_waits(ray_cluster):
    # The consumer takes 0.5 s over each block, asking for the next only near the end of the one it has.
    RecordSteps.steps = []
    for _ in _backpressured(ray_cluster, RecordSteps).iter_batches(batch_size=100):
        time.sleep(0.05)
    ends = RecordSteps.steps
    lengths = [(end - before, waiting) for (before, _), (end, waiting) in zip(ends, ends[1:])]
    quiet = [length for length, waiting in lengths if not waiting]
    waited = [length for length, waiting in lengths if waiting]
    assert quiet and waited
    # A step that ends with nobody waiting slept to the quiet pace (at the 20 ms pace: ~0.02 s) ...
    assert min(quiet) >= QUIET_STEP_S - 0.01
    # ... and one that ends with a consumer waiting was cut short.
    assert statistics.median(waited) < QUIET_STEP_S / 2


def test_a_shutdown_ends_the_quiet_rest_at_the_next_pace(ray_cluster):
    # A consumer that stops asking leaves the loop resting 250 ms a step; `shutdown` (a run's end, a
    # resize) waits for the loop, so the rest must end at the next 20 ms mark, not at its end.
    RecordSteps.steps = []
    batches = iter(_backpressured(ray_cluster, RecordSteps).iter_batches(batch_size=100))
    next(batches)
    time.sleep(1.0)  # nobody asks: every step rests
    executor = RecordSteps.executor
    ends = [end for end, _ in RecordSteps.steps]
    rests = [b - a for a, b in zip(ends[-4:], ends[-3:])]
    assert min(rests) >= QUIET_STEP_S - 0.01, rests  # resting, as the test above checks
    ended = len(RecordSteps.steps)
    deadline = time.monotonic() + 5
    while len(RecordSteps.steps) == ended:  # a new rest has just begun: ~230 ms of it left
        assert time.monotonic() < deadline, "the loop stopped stepping"
        time.sleep(0.005)
    time.sleep(0.02)
    exited: list[float] = []

    def watch() -> None:
        while executor.is_alive():
            time.sleep(0.002)
        exited.append(time.monotonic())

    watcher = threading.Thread(target=watch)
    watcher.start()
    asked = time.monotonic()
    executor.shutdown(force=True)
    watcher.join(timeout=5)
    assert exited and exited[0] - asked < QUIET_STEP_S / 2, exited[0] - asked if exited else None


def test_pacing_is_installed_once_and_travels_with_the_dataset(ray_cluster):
    ds = ray_cluster.data.range(10)
    pace_scheduling_loop(ds.context, 0.02)
    pace_scheduling_loop(ds.context, 0.03)
    assert ds.context.custom_execution_callback_classes.count(PacedSchedulingLoop) == 1
    assert ds.context.get_config("towerflow.executor_step_s") == 0.03
