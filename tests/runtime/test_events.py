"""StepAggregator: one event per global step, in order, however the workers' records arrive."""

import time

from towerflow.runtime.events import StepAggregator
from towerflow.runtime.worker_messages import StepRecord


def record(worker: int, step: int, verdict: str = "applied", replicas: int = 0) -> StepRecord:
    return StepRecord(
        worker, step, verdict, max(0, step - 1), 1.0, {}, 16, 0, finished_at=time.time(), replicas=replicas
    )


def steps(events) -> list[int]:
    return [e.global_step for e in events]


def test_a_later_step_heard_first_waits_for_the_gap_to_fill():
    # Async: worker 0 recorded step 25 before worker 1's push for step 24 returned.
    agg = StepAggregator(replicas_per_step=1, first_step=23)
    assert steps(agg.add([record(0, 23), record(0, 25)])) == [23]
    assert steps(agg.add([record(1, 24)])) == [24, 25]


def test_a_sync_step_waits_for_all_its_replicas_even_when_the_next_has_begun():
    agg = StepAggregator(replicas_per_step=2)
    assert steps(agg.add([record(0, 1), record(0, 2)])) == []
    events = agg.add([record(1, 1), record(1, 2)])
    assert steps(events) == [1, 2]
    assert all(e.workers == [0, 1] for e in events)


def test_once_a_worker_retires_a_step_needs_only_the_gradients_its_shard_aggregated():
    agg = StepAggregator(replicas_per_step=2, first_step=9)
    assert steps(agg.add([record(0, 9, replicas=2), record(1, 9, replicas=2)])) == [9]
    # Worker 1's data ran out: the shards now apply worker 0's gradient alone, and say so.
    assert steps(agg.add([record(0, 10, replicas=1), record(0, 11, replicas=1)])) == [10, 11]


def test_a_step_whose_record_never_comes_goes_out_after_the_grace_period():
    agg = StepAggregator(replicas_per_step=1, grace_s=0.05)
    assert steps(agg.add([record(0, 2), record(0, 3)])) == []  # step 1's worker was lost
    time.sleep(0.1)
    assert steps(agg.add([])) == [2, 3]
    assert steps(agg.add([record(1, 1)])) == []  # too late: never reported out of order


def test_resumed_runs_count_from_the_restored_step_and_flush_reports_the_rest():
    agg = StepAggregator(replicas_per_step=2, first_step=101)
    assert steps(agg.add([record(0, 101), record(1, 101), record(0, 102)])) == [101]
    assert steps(agg.flush()) == [102]


def test_dropped_gradients_are_counted_on_the_next_event():
    agg = StepAggregator(replicas_per_step=1)
    events = agg.add([record(2, -1, "stale"), record(0, 1)])
    assert events[0].dropped_stale == 1 and agg.dropped_total == 1
