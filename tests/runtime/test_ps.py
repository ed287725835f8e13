"""A parameter-server shard whose pieces come in gradient buckets, on a real Ray actor."""

import time

import numpy as np
import pytest
import ray

from towerflow.errors import FencedOut
from towerflow.runtime.fencing import fence_taken_actors
from towerflow.runtime.protocol import AsyncProtocol, SyncProtocol
from towerflow.runtime.ps import shard_actor
from towerflow.runtime.shard_replies import parameter_values


def test_each_bucket_aggregates_on_its_own_and_the_version_moves_once_all_are_applied(ray_cluster):
    # Piece "a" is pushed in bucket 1 (after backprop is done), piece "b" in bucket 0 (early).
    shard = shard_actor(0.1).remote(0)
    ray.get(
        shard.load.remote(
            ["a", "b"],
            [np.zeros(2, np.float32), np.zeros(3, np.float32)],
            {"name": "sgd", "learning_rate": 1.0},
            SyncProtocol(replicas_to_aggregate=2, total_num_replicas=3),  # one backup worker
            None,
            buckets=[1, 0],
        )
    )
    ray.get([shard.join.remote(worker, 0) for worker in range(3)])
    grad = {w: (np.full(2, w + 1.0, np.float32), np.full(3, 10.0 * (w + 1), np.float32)) for w in range(3)}

    early_a = shard.push.remote([grad[0][1]], 0, 0, 0)
    early_b = shard.push.remote([grad[1][1]], 0, 1, 0)  # bucket 0 has its two gradients: applied
    _wait_until(lambda: ray.get(shard.stats.remote())["bucket_versions"][0] == 1)
    late_c = shard.push.remote([grad[2][1]], 0, 2, 0)  # too late for bucket 0 of this step
    ready, _ = ray.wait([early_a, early_b, late_c], num_returns=3, timeout=1.0)
    assert ready == []  # every reply waits for the whole step
    assert ray.get(shard.ping.remote()) == 0  # bucket 1 is still open: no new version yet

    last_c = shard.push.remote([grad[2][0]], 0, 2, 1)  # worker 2 is in time for bucket 1
    last_a = shard.push.remote([grad[0][0]], 0, 0, 1)
    replies = ray.get([early_a, early_b, late_c, last_c, last_a])
    assert [r.verdict for r in replies] == ["applied", "applied", "stale", "applied", "applied"]
    assert {r.step for r in replies if r.verdict == "applied"} == {1}
    assert all(r.next.version == 1 for r in replies)
    late_b = ray.get(shard.push.remote([grad[1][0]], 0, 1, 1))
    assert late_b.verdict == "stale"
    # The last bucket's replies name whose gradients the step applied (what records wait for).
    assert [r.workers for r in replies[3:]] == [(0, 2), (0, 2)] and replies[0].workers == ()
    assert (
        ray.get(shard.step_workers.remote(0)) == {1: (0, 2)} and ray.get(shard.step_workers.remote(1)) == {}
    )

    a, b = ray.get(ray.get(shard.pull.remote(1)).params)
    np.testing.assert_allclose(a, -(grad[2][0] + grad[0][0]) / 2)  # SGD, lr 1: minus the mean
    np.testing.assert_allclose(b, -(grad[0][1] + grad[1][1]) / 2)
    stats = ray.get(shard.stats.remote())
    assert stats["version"] == 1 and stats["applied"] == 1
    assert stats["stale"] == 1  # counted once per gradient, by its last bucket
    ray.kill(shard)


def test_an_async_reply_carries_its_own_version_and_sync_replies_share_one_copy(ray_cluster):
    # Async: each push makes a version only its pusher reads, sent in the reply itself; two pushes
    # queued back to back must each get the values of their own version, not the newer one's.
    sgd = {"name": "sgd", "learning_rate": 1.0}
    shard = shard_actor(0.1).remote(0)
    ray.get(shard.load.remote(["w"], [np.zeros(4, np.float32)], sgd, AsyncProtocol(), None))
    gradients = (1.0, 2.0)
    replies = ray.get([shard.push.remote([np.full(4, g, np.float32)], 0, w) for w, g in enumerate(gradients)])
    # An async actor may run the two in either order: the one applied first makes version 1.
    assert sorted(r.next.version for r in replies) == [1, 2]
    assert not any(isinstance(r.next.params, ray.ObjectRef) for r in replies)
    values = parameter_values([r.next for r in replies])
    for reply, own, (value,) in zip(replies, gradients, values, strict=True):
        np.testing.assert_allclose(value, -own if reply.next.version == 1 else -sum(gradients))
    assert ray.get(shard.stats.remote())["publications"] == 2  # the two replies' versions only
    ray.kill(shard)

    # Sync: every worker of a step reads the same version: one copy in the object store.
    shard = shard_actor(0.1).remote(0)
    protocol = SyncProtocol(replicas_to_aggregate=2, total_num_replicas=2)
    ray.get(shard.load.remote(["w"], [np.zeros(4, np.float32)], sgd, protocol, None))
    ray.get([shard.join.remote(worker, 0) for worker in range(2)])
    replies = ray.get([shard.push.remote([np.full(4, g, np.float32)], 0, w) for w, g in ((0, 1.0), (1, 3.0))])
    refs = [r.next.params for r in replies]
    assert all(isinstance(ref, ray.ObjectRef) for ref in refs) and refs[0].hex() == refs[1].hex()
    np.testing.assert_allclose(parameter_values([replies[0].next])[0][0], -2.0)
    ray.kill(shard)


def test_a_stopping_workers_last_push_and_retire_leave_every_shard_at_one_version(ray_cluster):
    # How a stop drains: a worker's last push and its retire reach two shards in different orders.
    # Whichever comes first, each shard takes exactly one more step, so the final state is a cut.
    shards = [
        _two_zeros_shard(i, SyncProtocol(replicas_to_aggregate=2, total_num_replicas=2)) for i in range(2)
    ]
    ray.get([shard.join.remote(worker, 0) for shard in shards for worker in range(2)])
    grad = {w: np.full(2, w + 1.0, np.float32) for w in range(2)}
    a0, a1 = (s.push.remote([grad[0]], 0, 0) for s in shards)
    # Shard 0 gets worker 1's push, then its retire: both gradients make the step.
    b0 = shards[0].push.remote([grad[1]], 0, 1)
    assert ray.get(a0).verdict == ray.get(b0).verdict == "applied"
    ray.get(shards[0].retire.remote(1))
    # Shard 1 gets the retire first: worker 0's gradient is applied alone, worker 1's comes too late.
    ray.get(shards[1].retire.remote(1))
    assert ray.get(a1).verdict == "applied"
    assert ray.get(shards[1].push.remote([grad[1]], 0, 1)).verdict == "stale"

    assert [ray.get(s.ping.remote()) for s in shards] == [1, 1]
    np.testing.assert_allclose(ray.get(ray.get(shards[0].pull.remote(1)).params)[0], -1.5)
    np.testing.assert_allclose(ray.get(ray.get(shards[1].pull.remote(1)).params)[0], -1.0)
    for shard in shards:
        ray.kill(shard)


def test_a_workers_numbered_pushes_are_taken_in_its_order_whatever_order_they_arrive_in(ray_cluster):
    """overlap_push: a worker's next push may reach the shard before the one it sent first. Taken
    as they arrive, the first would count a staleness of 1 (and the second 0); taken in the worker's
    order, each counts what the worker computed it against."""
    shard = _two_zeros_shard(0, AsyncProtocol(max_staleness=0))
    ray.get(shard.join.remote(0, 7))
    one = [np.ones(2, np.float32)]
    second = shard.push.remote(one, 1, 0, 0, 0, True, 7, 1)  # computed on version 1: after the first
    ready, _ = ray.wait([second], timeout=1.0)
    assert ready == []  # it waits for the first
    first = ray.get(shard.push.remote(one, 0, 0, 0, 0, True, 7, 0))
    second = ray.get(second)
    assert (first.verdict, first.step, first.staleness) == ("applied", 1, 0)
    assert (second.verdict, second.step, second.staleness) == ("applied", 2, 0)  # none dropped as stale

    # A push held for its turn (push 3 waits for a push 2 that never comes, lost with its worker)
    # while the shard is loaded again (a rollback) is turned away, not taken into the new run.
    held = shard.push.remote(one, 2, 0, 0, 0, True, 7, 3)
    ready, _ = ray.wait([held], timeout=0.5)
    assert ready == []
    started = time.monotonic()
    sgd = {"name": "sgd", "learning_rate": 1.0}
    ray.get(shard.load.remote(["w0"], [np.zeros(2, np.float32)], sgd, AsyncProtocol(max_staleness=0), None))
    assert ray.get(held).verdict == "done" and time.monotonic() - started < 3  # not its 5-s wait
    values = parameter_values([ray.get(shard.pull.remote(0))])
    np.testing.assert_array_equal(values[0][0], np.zeros(2, np.float32))  # the new run untouched

    # Likewise when the shard finishes: a held push hears it is done at once, not after its wait.
    ray.get(shard.join.remote(0, 8))
    held = shard.push.remote(one, 0, 0, 0, 0, True, 8, 1)  # push 0 never comes
    ready, _ = ray.wait([held], timeout=0.5)
    assert ready == []
    started = time.monotonic()
    ray.get(shard.finish.remote())
    assert ray.get(held).verdict == "done" and time.monotonic() - started < 3
    assert ray.get(shard.stats.remote())["after_done"] == 1  # heard, not taken
    ray.kill(shard)


def test_async_shards_that_drifted_apart_settle_at_the_furthest_once_finished(ray_cluster):
    # A late gradient one shard applies and another drops as too stale: their versions drift.
    shards = [_two_zeros_shard(i, AsyncProtocol(max_staleness=1)) for i in range(2)]
    one = [np.ones(2, np.float32)]
    for _ in range(2):  # worker 0 at both: version 2
        ray.get([s.push.remote(one, ray.get(s.ping.remote()), 0) for s in shards])
    ray.get(shards[1].push.remote(one, 2, 1))  # worker 1's push reaches shard 1 in time: version 3
    assert ray.get(shards[0].push.remote(one, 0, 1)).verdict == "stale"  # and shard 0 too late
    assert [ray.get(s.ping.remote()) for s in shards] == [2, 3]

    with pytest.raises(RuntimeError, match="still training"):
        ray.get(shards[0].settle_at.remote(3))
    ray.get([s.finish.remote() for s in shards])
    assert ray.get([s.settle_at.remote(3) for s in shards]) == [3, 3]
    snapshot = ray.get(shards[0].snapshot.remote(3))  # its last state, under the furthest's version
    assert snapshot.version == 3
    np.testing.assert_allclose(snapshot.values[0], -2.0)  # the two updates it applied
    assert ray.get(shards[1].settle_at.remote(2)) == 3  # never back
    for shard in shards:
        ray.kill(shard)


def _two_zeros_shard(i: int, protocol):
    """Shard `i` holding one variable `w{i}` of two zeros, plain SGD at learning rate 1."""
    shard = shard_actor(0.1).remote(i)
    sgd = {"name": "sgd", "learning_rate": 1.0}
    ray.get(shard.load.remote([f"w{i}"], [np.zeros(2, np.float32)], sgd, protocol, None))
    return shard


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    """An async actor runs concurrent calls in no set order: wait for one to land before the next."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the shard never got there"
        time.sleep(0.02)


def test_a_lost_workers_retire_completes_a_step_that_still_names_its_gradient(ray_cluster):
    # Three sync workers: 0 and 1 pushed into step 1, then worker 1 died before its record. Its
    # retire completes the step with both gradients, and the shard says worker 1 went into it:
    # the driver stops waiting for its record (StepAggregator.write_off).
    shard = shard_actor(0.1).remote(0)
    sgd = {"name": "sgd", "learning_rate": 1.0}
    protocol = SyncProtocol(replicas_to_aggregate=3, total_num_replicas=3)
    ray.get(shard.load.remote(["w"], [np.zeros(2, np.float32)], sgd, protocol, None))
    ray.get([shard.join.remote(worker, 0) for worker in range(3)])
    held = [shard.push.remote([np.ones(2, np.float32)], 0, worker, 0, 16) for worker in (0, 1)]
    _wait_until(lambda: len(ray.get(shard.examples_taken.remote())) == 2)
    assert ray.get(shard.step_workers.remote(0)) == {}
    ray.get(shard.retire.remote(1))
    assert [r.workers for r in ray.get(held)] == [(0, 1), (0, 1)]
    assert ray.get(shard.step_workers.remote(0)) == {1: (0, 1)}
    ray.kill(shard)


def test_a_lost_workers_late_push_neither_counts_nor_takes_its_replacements_place(ray_cluster):
    # Two sync workers; worker 1 is lost with a push on its way. The driver retires it, and its
    # replacement joins under its id (another incarnation) before the lost one's push arrives.
    shard = shard_actor(0.1).remote(0)
    sgd = {"name": "sgd", "learning_rate": 1.0}
    protocol = SyncProtocol(replicas_to_aggregate=2, total_num_replicas=2)
    ray.get(shard.load.remote(["w"], [np.zeros(2, np.float32)], sgd, protocol, None))
    ray.get([shard.join.remote(0, 10), shard.join.remote(1, 11)])
    ray.get(shard.retire.remote(1))  # the driver's, of the lost worker
    ray.get(shard.join.remote(1, 12))  # its replacement
    late = ray.get(shard.push.remote([np.full(2, 100.0, np.float32)], 0, 1, 0, 16, True, 11))
    assert late.verdict == "retired" and late.next.done  # no steps left for the lost incarnation
    ray.get(shard.retire.remote(1, 11))  # nor does its own retire retire its replacement
    pushes = [
        shard.push.remote([np.full(2, gradient, np.float32)], 0, worker, 0, 16, True, incarnation)
        for worker, gradient, incarnation in ((0, 1.0, 10), (1, 3.0, 12))
    ]
    assert [r.verdict for r in ray.get(pushes)] == ["applied", "applied"]  # the replacement's counts
    np.testing.assert_allclose(ray.get(ray.get(shard.pull.remote(1)).params)[0], -2.0)  # not the 100
    assert ray.get(shard.examples_taken.remote()) == {0: 16, 1: 16}  # the late batch's rows went over
    assert ray.get(shard.stats.remote())["retired"] == 1
    ray.kill(shard)


def test_a_shard_fenced_by_a_newer_driver_refuses_the_older_ones_orders(ray_cluster):
    # runtime/fencing.py: a driver taking a run over fences its shards above every earlier term.
    shard = shard_actor(0.1).remote(0)
    sgd = {"name": "sgd", "learning_rate": 1.0}
    ray.get(shard.load.remote(["w"], [np.zeros(2, np.float32)], sgd, AsyncProtocol(), None))
    assert fence_taken_actors([shard], "run-x") == 1  # one above the term it held (the first driver's, 0)
    for refused in (
        shard.finish.remote(term=0),
        shard.resize.remote(2, 2, 0, term=0),
        shard.load.remote(["w"], [np.ones(2, np.float32)], sgd, AsyncProtocol(), None, term=0),
    ):
        with pytest.raises(FencedOut, match="newer driver of the run .term 1; the call's 0"):
            ray.get(refused)
    reply = ray.get(shard.push.remote([np.ones(2, np.float32)], 0, 0))  # untouched: still training
    assert reply.verdict == "applied" and not reply.next.done
    assert ray.get(shard.finish.remote(term=1)) == 1  # the new driver's order
    ray.get(shard.reset.remote(0))  # a kept shard's next run (actor_pool.py) starts at term 0
    assert ray.get(shard.term.remote()) == 0
    ray.kill(shard)


def test_two_callers_waiting_for_one_version_both_get_its_snapshot(ray_cluster):
    """A memory checkpoint and a stored one may ask for the same next version: the first answered
    took the capture away, and the second waited for that version again, for the rest of the run."""
    shard = _two_zeros_shard(0, AsyncProtocol(max_staleness=0))
    memory, stored = shard.snapshot.remote(1), shard.snapshot.remote(1)
    time.sleep(0.5)  # both wait at the shard (were the push first, both would find version 1 at once)
    ray.get(shard.push.remote([np.ones(2, np.float32)], 0, 0))
    done, _ = ray.wait([memory, stored], num_returns=2, timeout=10)
    assert len(done) == 2, "the second caller was left waiting"
    assert [s.version for s in ray.get([memory, stored])] == [1, 1]
    ray.kill(shard)


def test_a_shard_not_loaded_for_this_run_has_no_position_to_take_over(ray_cluster):
    """A driver lost as its run started leaves shards made (or a kept run's, reset) but not loaded:
    a take-over must not go on from them (before, a fresh one's answer was an AttributeError, and a
    reset kept shard's the last run's version and data position)."""
    sgd = {"name": "sgd", "learning_rate": 1.0}
    shard = shard_actor(0.1).remote(0)
    assert ray.get(shard.live_position.remote()) is None
    ray.get(
        shard.load.remote(["w"], [np.zeros(4, np.float32)], sgd, AsyncProtocol(), None, initial_version=7)
    )
    assert ray.get(shard.live_position.remote()) == (7, 0, 0)
    ray.get(shard.reset.remote(0))  # the next run of a kept shard, before its load
    assert ray.get(shard.live_position.remote()) is None
    ray.kill(shard)
