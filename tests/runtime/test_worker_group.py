"""The worker group's bounds on waiting (runtime/worker_group.py, its watchdogs in worker_watch.py),
on real Ray actors standing in for workers: a replacement Ray cannot place, a worker that does
not stop when asked, and workers a newer driver has fenced (runtime/fencing.py)."""

from __future__ import annotations

import threading
import time

import pytest

from towerflow.errors import FencedOut
from towerflow.runtime.fencing import DriverTerm
from towerflow.runtime.worker_group import WorkerGroup
from towerflow.runtime.worker_messages import WorkerReport

pytestmark = pytest.mark.timeout(120)


class _Worker(DriverTerm):
    """A worker's control surface: `run` trains until stopped (or for ever, if `deaf`), refused to
    a driver of an earlier term, as TowerWorker's."""

    def __init__(self, deaf: bool = False) -> None:
        self._stop = threading.Event()
        self._deaf = deaf

    def run(self, *args, run_number: int = 1, term: int = 0) -> dict:
        self._obey(term, "starting a worker's run")
        while self._deaf or not self._stop.is_set():
            time.sleep(0.05)
        return {"steps": 0}

    def drain(self) -> WorkerReport:
        return WorkerReport([], None, term=self._term)

    def request_stop(self, run_number: int) -> None:
        self._stop.set()

    def devices_used(self) -> list:
        return []


class _StarvedWorker(_Worker):
    """A worker whose next batch never comes (or, `fed`, one that keeps computing)."""

    def __init__(self, fed: bool = False) -> None:
        super().__init__()
        self._fed = fed
        self._since = time.monotonic()

    def drain(self) -> WorkerReport:
        return WorkerReport([], None, None if self._fed else time.monotonic() - self._since)


def _poll_until_lost(group: WorkerGroup, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = group.poll(0.2)
        if status.losses:
            return status.losses
    raise AssertionError(f"no loss within {timeout_s} s")


def test_a_replacement_that_no_node_has_room_for_is_lost_after_the_start_timeout(ray_cluster, caplog):
    ray = ray_cluster
    worker = ray.remote(num_cpus=0, max_concurrency=4)(_Worker)
    nowhere = worker.options(resources={"a-resource-no-node-has": 1})
    placeable = iter([True])
    group = WorkerGroup(
        lambda _id: (worker if next(placeable, False) else nowhere).remote(),
        timeout_s=60,
        start_timeout_s=2,
        tell_waiting_every_s=0.5,
    )
    group.start([0])
    group.run(0)
    group.poll(0.5)
    ray.kill(group.slots[0].actor)
    (lost,) = _poll_until_lost(group, 20)
    assert lost.index == 0 and not lost.hung
    group.replace(0)  # Ray cannot place this one
    (unstarted,) = _poll_until_lost(group, 20)
    assert unstarted.index == 0 and "did not start within" in unstarted.cause
    assert "training.failure.start_timeout_s" in unstarted.cause
    assert group.slots[0].lost
    # While it waited, the log said so (not silence until the timeout), with the room there is.
    told = [r.getMessage() for r in caplog.records if "replacement has not started after" in r.getMessage()]
    assert told and "worker 0's" in told[0] and "CPU free" in told[0], told
    assert "counts as lost after 2 s" in told[0], told
    group.kill()


def test_a_worker_that_does_not_stop_when_asked_is_killed_and_reported_hung(ray_cluster):
    ray = ray_cluster
    worker = ray.remote(num_cpus=0, max_concurrency=4)(_Worker)
    group = WorkerGroup(lambda worker_id: worker.remote(deaf=worker_id == 1), timeout_s=60)
    group.start([0, 1])
    group.run(0)
    group.run(1)
    ray.get([slot.actor.drain.remote() for slot in group.slots.values()])  # both started (slow hours)
    group.poll(0.5)
    status = group.stop_and_drain(timeout_s=3)
    assert 0 in status.finished  # it stopped after its step
    (hung,) = status.losses
    assert hung.index == 1 and hung.hung and "did not stop within 3 s" in hung.cause
    assert group.running == []
    group.kill()


def test_workers_all_starved_of_data_are_told_of_then_fail_the_run(ray_cluster, caplog):
    ray = ray_cluster
    worker = ray.remote(num_cpus=0, max_concurrency=4)(_StarvedWorker)
    group = WorkerGroup(
        lambda _id: worker.remote(), timeout_s=60, start_timeout_s=2, tell_waiting_every_s=0.5
    )
    group.start([0, 1])
    group.run(0)
    group.run(1)
    deadline = time.monotonic() + 20
    while (status := group.poll(0.2)).stalled is None:
        assert time.monotonic() < deadline, "the starved run was never failed"
    assert not status.losses  # no worker is at fault: none is replaced
    message = str(status.stalled)
    assert type(status.stalled).__name__ == "ClusterError" and status.fatal is status.stalled
    assert "no batch reached any worker for" in message and "CPU free" in message, message
    assert "training.failure.start_timeout_s: 2" in message, message
    told = [r.getMessage() for r in caplog.records if "no batch has reached any worker" in r.getMessage()]
    assert told and "the run fails after 2 s" in told[0], told  # said while it lasted, before failing
    group.kill()


def test_one_worker_still_fed_is_no_stall(ray_cluster, caplog):
    ray = ray_cluster
    worker = ray.remote(num_cpus=0, max_concurrency=4)(_StarvedWorker)
    group = WorkerGroup(
        lambda worker_id: worker.remote(fed=worker_id == 1),
        timeout_s=60,
        start_timeout_s=1,
        tell_waiting_every_s=0.2,
    )
    group.start([0, 1])
    group.run(0)
    group.run(1)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert group.poll(0.2).stalled is None
    assert not [r for r in caplog.records if "no batch has reached" in r.getMessage()]
    group.kill()


class _SlowToAnswer(_Worker):
    """Answers its first drain at once and its second after `slow_s`."""

    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self._drains, self._slow_s = 0, slow_s

    def drain(self) -> WorkerReport:
        self._drains += 1
        if self._drains == 2:
            time.sleep(self._slow_s)
        return super().drain()


class _BusyOnceFenced(_Worker):
    """Says it has been in one step for long once a newer driver has fenced it (under that driver,
    a long step or none: not the old driver's to judge)."""

    def drain(self) -> WorkerReport:
        return WorkerReport([], 1000.0 if self._term else None, term=self._term)


def test_a_worker_that_a_newer_driver_fenced_stops_the_poll_and_is_left_alone(ray_cluster):
    ray = ray_cluster
    busy, deaf = (
        ray.remote(num_cpus=0, max_concurrency=4)(_BusyOnceFenced),
        ray.remote(num_cpus=0, max_concurrency=4)(_Worker),
    )
    group = WorkerGroup(
        lambda worker_id: busy.remote() if worker_id == 0 else deaf.remote(deaf=True), timeout_s=1
    )
    group.start([0, 1])
    group.run(0)
    group.run(1)
    group.poll(0.2)
    # A driver took the run over (run_keeper.py); worker 0 now answers as if in a step for 1,000 s,
    # past this group's 1 s timeout: a hang, were it this driver's to judge.
    ray.get(group.slots[0].actor.fence.remote(2))
    with pytest.raises(FencedOut, match=r"newer driver of the run \(term 2; this driver's 0\)"):
        for _ in range(20):
            group.poll(0.2)
    assert group.newer_term == 2
    assert not any(slot.lost for slot in group.slots.values())  # nothing replaced, nothing killed
    assert [ray.get(slot.actor.term.remote(), timeout=10) for slot in group.slots.values()] == [2, 0]
    group.kill()


def test_a_run_a_fenced_worker_refuses_is_the_run_taken_over_not_a_users_error(ray_cluster):
    ray = ray_cluster
    worker = ray.remote(num_cpus=0, max_concurrency=4)(_Worker)
    group = WorkerGroup(lambda _id: worker.remote(), timeout_s=60)
    group.start([0])
    ray.get(group.slots[0].actor.fence.remote(3))
    group.run(0)  # this driver's term: 0
    ray.wait([group.slots[0].run_ref], timeout=30)
    with pytest.raises(FencedOut, match=r"newer driver of the run \(term 3; this driver's 0\)"):
        group.poll(0.2)  # the term the worker told, not merely one above this driver's
    group.kill()


def test_the_drivers_own_pause_is_not_taken_for_its_workers_silence(ray_cluster, caplog):
    ray = ray_cluster
    worker = ray.remote(num_cpus=0, max_concurrency=4)(_SlowToAnswer)
    group = WorkerGroup(lambda _id: worker.remote(slow_s=4.0), timeout_s=2)
    group.start([0])
    group.run(0)
    deadline = time.monotonic() + 30
    while not group.slots[0].answered:  # its first drain (the actor's start may take seconds)
        assert not group.poll(0.1).losses and time.monotonic() < deadline
    group.poll(0.1, answer_s=0.1)  # its second: unanswered for 4 s
    time.sleep(2.5)  # the driver paused (a SIGSTOP, a starved process) past the 2 s timeout
    deadline = time.monotonic() + 10
    while group.slots[0].drain_ref is not None or group.slots[0].asked_at == 0:
        assert not group.poll(0.2).losses, "the driver's own pause was taken for a hang"
        assert time.monotonic() < deadline
    assert not group.slots[0].lost
    told = [r.getMessage() for r in caplog.records if "did not poll its workers" in r.getMessage()]
    assert told and "their silence meanwhile is not counted" in told[0], told
    group.kill()


def test_withdrawing_no_spares_withdraws_none(ray_cluster):
    """The elastic loop withdraws `-wanted` spares each turn: where it wants more (a negative
    count) none go; before, the slice withdrew all but that many, spares the run waited for."""
    worker = ray_cluster.remote(num_cpus=0)(_Worker)
    group = WorkerGroup(lambda _id, spare=False: worker.remote(), timeout_s=60)
    spares = [group.request_spare() for _ in range(3)]
    group.drop_spares(-1)
    assert sorted(group.spares) == spares
    group.drop_spares(2)  # the newest two go
    assert sorted(group.spares) == spares[:1]
    group.drop_spares(1)
