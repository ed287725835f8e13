"""StepAggregator: one event per global step, in order, however the workers' records arrive."""

import time

from towerflow.runtime.events import StepAggregator, past_step_events
from towerflow.runtime.worker_messages import StepRecord


def record(worker: int, step: int, verdict: str = "applied", workers: tuple[int, ...] = ()) -> StepRecord:
    return StepRecord(
        worker, step, verdict, max(0, step - 1), 1.0, {}, 16, 0, finished_at=time.time(), workers=workers
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
    assert steps(agg.add([record(0, 9, workers=(0, 1)), record(1, 9, workers=(0, 1))])) == [9]
    # Worker 1's data ran out: the shards now apply worker 0's gradient alone, and say so.
    assert steps(agg.add([record(0, 10, workers=(0,)), record(0, 11, workers=(0,))])) == [10, 11]


def test_a_sync_step_waits_for_the_records_of_the_workers_it_aggregated():
    # Backup workers: step 4 took workers 0 and 2; worker 1's record of step 4 is not one of them.
    agg = StepAggregator(replicas_per_step=2, first_step=4)
    assert steps(agg.add([record(0, 4, workers=(0, 2))])) == []
    assert steps(agg.add([record(2, 4, workers=(0, 2))])) == [4]


def test_a_lost_workers_records_are_written_off_and_its_steps_go_out_at_once():
    # Sync: worker 1 pushed into steps 6 and 7 and was killed before recording them; the shards
    # then went on with worker 0 alone (step 8).
    agg = StepAggregator(replicas_per_step=2, first_step=6, grace_s=60)
    assert steps(agg.add([record(0, 6, workers=(0, 1)), record(0, 7, workers=(0, 1))])) == []
    agg.write_off({1}, {5: (0, 1), 6: (0, 1), 7: (0, 1), 8: (0,)})
    events = agg.add([record(0, 8, workers=(0,))])
    assert steps(events) == [6, 7, 8]
    assert [e.workers for e in events] == [[0], [0], [0]]
    assert agg.overdue_total == 0


def test_a_step_only_a_lost_worker_made_goes_by_unreported():
    # Async: worker 1 applied step 3 and was killed before its record; worker 0 made step 4.
    agg = StepAggregator(replicas_per_step=1, first_step=3, grace_s=60)
    assert steps(agg.add([record(0, 4, workers=(0,))])) == []
    agg.write_off({1}, {3: (1,), 4: (0,)})
    assert steps(agg.add([])) == [4]
    assert agg.last_emitted == 4


def test_a_written_off_step_still_waits_for_a_live_workers_record_on_its_way():
    agg = StepAggregator(replicas_per_step=2, first_step=1, grace_s=60)
    agg.write_off({1}, {1: (0, 1)})
    assert steps(agg.add([])) == []  # worker 0's record of step 1 has not come yet
    assert steps(agg.add([record(0, 1, workers=(0, 1))])) == [1]


def test_a_step_whose_record_never_comes_goes_out_after_the_grace_period():
    agg = StepAggregator(replicas_per_step=1, grace_s=0.05)
    assert steps(agg.add([record(0, 2), record(0, 3)])) == []  # step 1's worker was lost
    time.sleep(0.1)
    assert steps(agg.add([])) == [2, 3]
    assert agg.overdue_total == 1  # step 2 (a gap before it); step 3 was then in order
    assert steps(agg.add([record(1, 1)])) == []  # too late: never reported out of order


def test_resumed_runs_count_from_the_restored_step_and_flush_reports_the_rest():
    agg = StepAggregator(replicas_per_step=2, first_step=101)
    assert steps(agg.add([record(0, 101), record(1, 101), record(0, 102)])) == [101]
    assert steps(agg.flush()) == [102]


def test_dropped_gradients_are_counted_on_the_next_event():
    agg = StepAggregator(replicas_per_step=1)
    events = agg.add([record(2, -1, "stale"), record(0, 1)])
    assert events[0].dropped_stale == 1 and agg.dropped_total == 1


def test_past_steps_are_events_in_step_order_counting_their_examples_back():
    # A lost driver's kept workers: worker 0 told of steps 48..50 (the driver drained them, and
    # may not have logged them), both then of 51..52, taken with no driver; a stale gradient and
    # a non-finite loss (nothing applied) are no steps. The shards' data position is after 52.
    records = [record(1, 52), record(0, 48), record(0, 49), record(1, 51), record(0, 50)]
    records += [
        record(0, 51),
        record(0, 52),
        record(1, -1, "stale"),
        StepRecord.nonfinite(0, 52, float("nan"), 16),
    ]
    events = past_step_events(records, examples_seen_after=1000)
    assert steps(events) == [48, 49, 50, 51, 52]
    assert [e.workers for e in events] == [[0], [0], [0], [0, 1], [0, 1]]
    assert [e.examples_seen for e in events] == [904, 920, 936, 968, 1000]
    assert past_step_events([record(1, -1, "stale")], examples_seen_after=1000) == []
