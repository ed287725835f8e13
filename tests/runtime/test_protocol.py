import pytest

from towerflow.runtime.protocol import AsyncProtocol, SyncProtocol, make_protocol, protocol_for, step_shape
from towerflow.shared_types import StepShape


def _joined(replicas_to_aggregate: int, total_num_replicas: int) -> SyncProtocol:
    """A sync protocol whose workers 0..total-1 have joined, each as incarnation 0."""
    p = SyncProtocol(replicas_to_aggregate, total_num_replicas)
    for worker in range(total_num_replicas):
        p.on_join(worker, 0)
    return p


def test_sync_applies_once_enough_replicas_arrive():
    p = _joined(replicas_to_aggregate=2, total_num_replicas=2)
    assert p.on_push(version_read=0, version=0, worker=0, incarnation=0).verdict == "held"
    decision = p.on_push(version_read=0, version=0, worker=1, incarnation=0)
    assert decision.verdict == "apply" and decision.count == 2  # the shard applies the mean of both
    assert p.on_push(version_read=1, version=1, worker=0, incarnation=0).verdict == "held"  # a fresh step


def test_sync_drops_gradients_of_an_older_version():
    p = _joined(2, 3)
    decision = p.on_push(version_read=4, version=5, worker=2, incarnation=0)
    assert decision.verdict == "stale" and decision.staleness == 1


def test_sync_backup_worker_is_not_waited_for():
    p = _joined(2, 3)
    assert p.on_push(0, 0, worker=2, incarnation=0).verdict == "held"
    assert p.on_push(0, 0, worker=0, incarnation=0).verdict == "apply"
    assert (
        p.on_push(0, 1, worker=1, incarnation=0).verdict == "stale"
    )  # the third replica came after the update


def test_sync_one_contribution_per_worker_per_step():
    p = _joined(2, 2)
    p.on_push(0, 0, worker=0, incarnation=0)
    assert p.on_push(0, 0, worker=0, incarnation=0).verdict == "rejected"


def test_retired_worker_lets_the_others_complete_a_step():
    p = _joined(2, 2)
    assert p.on_push(0, 0, worker=0, incarnation=0).verdict == "held"
    decision = p.on_retire(1)
    assert decision.verdict == "apply" and decision.count == 1


def test_retiring_with_nothing_held_applies_nothing():
    p = _joined(2, 2)
    assert p.on_retire(1).verdict == "held"


def test_sync_waits_for_the_next_version():
    assert SyncProtocol(2, 2).next_version_to_read(7) == 8
    assert AsyncProtocol().next_version_to_read(7) == 0


def test_async_applies_at_once_and_measures_staleness():
    decision = AsyncProtocol().on_push(version_read=3, version=5, worker=0, incarnation=0)
    assert decision.verdict == "apply" and decision.count == 1 and decision.staleness == 2


def test_async_bounded_staleness_rejects_older_gradients():
    p = AsyncProtocol(max_staleness=1)
    assert p.on_push(4, 5, 0, incarnation=0).verdict == "apply"
    assert p.on_push(3, 5, 0, incarnation=0).verdict == "stale"


def test_async_drops_a_gradient_read_from_a_version_the_shard_has_not_reached():
    """Only an earlier run's worker has read a newer version than the shard holds: one whose push
    arrives after the shards rolled back (a lost worker's, late). Not applied to the new run."""
    assert AsyncProtocol().on_push(version_read=9, version=5, worker=0, incarnation=0).verdict == "retired"
    assert AsyncProtocol().on_push(version_read=5, version=5, worker=0, incarnation=0).verdict == "apply"


def test_make_protocol():
    assert isinstance(
        make_protocol("sync", replicas_to_aggregate=1, total_num_replicas=1, max_staleness=None), SyncProtocol
    )
    assert (
        make_protocol("async", replicas_to_aggregate=1, total_num_replicas=1, max_staleness=2).max_staleness
        == 2
    )


def test_the_protocol_says_what_differs_between_the_modes():
    assert protocol_for("sync").lockstep and not protocol_for("async").lockstep
    assert step_shape("sync", 3) == StepShape(lockstep=True, batches_per_update=3)
    assert step_shape("async", 3) == StepShape(lockstep=False, batches_per_update=1)
    with pytest.raises(ValueError, match="choose sync or async"):
        protocol_for("hogwild")


def test_sync_drops_the_pushes_of_a_worker_retired_or_replaced_under_its_id():
    p = _joined(2, 2)
    p.on_retire(1)  # lost: the driver retires it
    assert p.on_push(0, 0, worker=1, incarnation=0).verdict == "retired"  # its late push
    p.on_join(1, 7)  # its replacement, under its id
    assert p.on_push(0, 0, worker=1, incarnation=0).verdict == "retired"  # still the lost one's
    assert p.on_retire(1, incarnation=0).verdict == "held"  # the lost one's own retire: nobody goes
    assert p.on_push(0, 0, worker=1, incarnation=7).verdict == "held"  # the replacement takes part
    assert p.on_push(0, 0, worker=0, incarnation=0).verdict == "apply"


def test_a_resize_starts_the_steps_again_with_the_workers_that_join():
    p = _joined(2, 2)
    p.resize(1, 1)
    assert p.on_push(0, 0, worker=1, incarnation=0).verdict == "retired"  # not of the new set
    p.on_join(0, 3)
    assert p.on_push(0, 0, worker=0, incarnation=3).verdict == "apply"
