"""The run's control point as the keeper of a kept run's shards: its lease, and the end it puts to
a run that has had no driver for its grace period (real Ray actors and placement groups). The whole
path, a driver SIGKILLed and its shards taken over, is in test_multinode_driver_loss.py."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import ray
from ray.util import placement_group_table
from ray.util.placement_group import placement_group
from support import blob_spec

from towerflow.errors import ClusterError, RunTakenOver
from towerflow.runtime.run_control import (
    ASK_AFTER_S,
    LEASE_FRESH_S,
    ControlPoint,
    RunControl,
    Takeover,
    control_name,
    find_control,
    recall,
    request_scale,
)
from towerflow.runtime.run_keeper import take_over_live_run
from towerflow.spec import validate_spec


def _gone(actor) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def _keeper(run_id: str, *args: Any) -> Any:
    """A kept run's control point as a driver makes it (detached, named after the run; Ray starts
    it again), with RunControl's arguments after the run id."""
    return RunControl.options(name=control_name(run_id), namespace="towerflow", lifetime="detached").remote(
        run_id, *args
    )


def _once_restarted(ask, done) -> Any:
    """The answer of `ask()` (a call to an actor Ray is starting again) once `done` takes it, or
    the last one after 30 s (None while it was still restarting)."""
    deadline, answer = time.monotonic() + 30, None
    while not done(answer) and time.monotonic() < deadline:
        time.sleep(0.5)
        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarting
            answer = ray.get(ask(), timeout=5)
    return answer


def test_a_kept_run_without_a_driver_loses_its_placement_groups_and_its_keeper(ray_cluster):
    run_id = uuid.uuid4().hex
    group = placement_group([{"CPU": 0.5}], name=f"towerflow-test-{run_id}", lifetime="detached")
    ray.get(group.ready())
    keeper = _keeper(run_id, 3.0, (f"towerflow-test-{run_id}",))
    # Its process killed: Ray starts it again, and it still knows the run's groups.
    os.kill(ray.get(keeper.pid.remote()), signal.SIGKILL)
    # Nobody renews its lease: three seconds after its start, the run ends.
    deadline = time.monotonic() + 60
    while placement_group_table(group)["state"] != "REMOVED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert placement_group_table(group)["state"] == "REMOVED"
    assert _gone(keeper)


def test_a_renewed_lease_keeps_the_run_and_takes_worker_counts(ray_cluster):
    run_id = uuid.uuid4().hex
    control = ControlPoint(run_id, grace_s=3.0)  # the driver's side renews every 2 s
    try:
        time.sleep(6)
        assert find_control(run_id) is not None
        request_scale(run_id, 3)
        # The controller asks without waiting, once a turn: the count comes at one of them.
        deadline, counts = time.monotonic() + 30, []
        while 3 not in counts and time.monotonic() < deadline:
            counts.append(control.new_worker_count())
            time.sleep(0.2)
        assert 3 in counts, counts
    finally:
        control.close()


def test_scaling_a_kept_run_whose_driver_is_gone_is_refused(ray_cluster):
    run_id = uuid.uuid4().hex
    keeper = _keeper(run_id, 60.0)
    try:
        ray.get(keeper.__ray_ready__.remote())
        time.sleep(11)  # no renewal for longer than a live driver leaves between two
        with pytest.raises(ClusterError, match=f"no running towerflow job with run id {run_id}"):
            request_scale(run_id, 2)
        assert ray.get(keeper.wanted_workers.remote()) is None  # not left for a later driver to apply
    finally:
        ray.kill(keeper)


def test_a_control_point_restarted_by_ray_is_told_the_run_again_by_its_driver(ray_cluster):
    run_id = uuid.uuid4().hex
    control = ControlPoint(run_id, grace_s=60.0)  # the driver's side renews every 2 s
    job = ray.get_runtime_context().get_job_id()
    try:
        control.keep()
        control.remember({"shards": ["the run's"]})  # what a new driver would take over
        os.kill(ray.get(control.actor.pid.remote()), signal.SIGKILL)  # Ray starts it again
        told = _once_restarted(control.actor.driver_job.remote, lambda told: told == job)
        assert told == job
        assert ray.get(control.actor.take_over.remote(job, job)) == Takeover({"shards": ["the run's"]})
    finally:
        control.close()


def test_a_control_point_restarted_with_its_driver_gone_still_hands_the_run_over(ray_cluster):
    """The driver's node lost takes the driver and the control point beside it: Ray starts the
    control point again elsewhere, and it reads back what it was told from the GCS's store."""
    run_id = uuid.uuid4().hex
    shard = RunControl.options(num_cpus=0).remote()  # an actor of the run, whose handle is handed over
    keeper = _keeper(run_id, 60.0, (), "its own id")
    try:
        ray.get(keeper.keep.remote("a lost driver's job"))
        ray.get(keeper.remember.remote({"shards": [shard]}, "a lost driver's job"))
        first = ray.get(keeper.pid.remote())
        deadline = time.monotonic() + 30  # its record is written by a thread of its own
        while recall(run_id, "its own id")[1] is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert recall(run_id, "another control point's id") == (None, None)  # a new one of the run's
        os.kill(first, signal.SIGKILL)  # nobody tells it again: its driver is gone
        pid = _once_restarted(keeper.pid.remote, lambda pid: pid not in (None, first))
        assert pid != first
        assert ray.get(keeper.driver_job.remote()) == "a lost driver's job"
        handover = ray.get(keeper.take_over.remote("the new driver's job", "a lost driver's job")).handover
        assert ray.get(handover["shards"][0].pid.remote()) == ray.get(shard.pid.remote())  # the same actor
    finally:
        with contextlib.suppress(ray.exceptions.RayActorError):  # it ends itself as it answers
            ray.get(keeper.end.remote())
        ray.kill(shard)
    # Its end deleted the record: a control point of the run made later starts knowing nothing.
    assert recall(run_id, "its own id") == (None, None)


def _taken_over_by_another_driver(control: ControlPoint, *, renewing: bool = True) -> None:
    control.keep()
    control.remember({"shards": ["the run's"]})
    control.confirm()  # its own run: nothing raised
    if not renewing:
        control.let_go()  # no renewal from here on, as while its process is stopped
    old_job = ray.get_runtime_context().get_job_id()
    taken = ray.get(control.actor.take_over.remote("the new driver's job", old_job))
    assert taken == Takeover({"shards": ["the run's"]})


def test_a_driver_whose_run_was_taken_over_hears_so_at_its_next_renewal_and_is_not_listened_to(ray_cluster):
    control = ControlPoint(uuid.uuid4().hex, grace_s=60.0)  # the driver's side renews every 2 s
    try:
        _taken_over_by_another_driver(control)
        control.remember({"shards": ["a stale view"]})  # not taken: the run is the new driver's
        deadline, heard = time.monotonic() + 10, None
        while heard is None and time.monotonic() < deadline:
            try:
                control.confirm()
                time.sleep(0.2)
            except RunTakenOver as exc:
                heard = str(exc)
        assert heard is not None and "taken over by another driver (Ray job the new driver's job)" in heard
        assert ray.get(control.actor.driver_job.remote()) == "the new driver's job"
        taken = ray.get(control.actor.take_over.remote("the new driver's job", "the new driver's job"))
        assert taken == Takeover({"shards": ["the run's"]})
    finally:
        control.close()


def test_a_driver_whose_lease_may_have_lapsed_asks_before_it_acts(ray_cluster):
    """As a driver paused past its lease and woken: its lease thread has not answered yet, so the
    controller's `confirm` asks the control point itself."""
    control = ControlPoint(uuid.uuid4().hex, grace_s=60.0)
    try:
        _taken_over_by_another_driver(control, renewing=False)
        control.confirm()  # renewed just now: it does not ask (nor know)
        time.sleep(ASK_AFTER_S + 0.5)
        with pytest.raises(RunTakenOver, match="had not renewed its lease for [5-9] s"):
            control.confirm()
    finally:
        control.close()


def test_a_driver_whose_control_point_ended_for_good_stops_and_says_why_ray_says_it_ended(ray_cluster):
    control = ControlPoint(uuid.uuid4().hex, grace_s=60.0)
    try:
        control.keep()
        control.let_go()  # no renewal from here on, as while its process is stopped
        ray.kill(control.actor)  # no restart: as the run's end kills it
        time.sleep(ASK_AFTER_S + 0.5)
        with pytest.raises(RunTakenOver, match=r"control point has ended \(.*; Ray says: .*ray\.kill"):
            control.confirm()
    finally:
        control.close()


def _a_lost_drivers_run(run_id: str) -> Any:
    keeper = _keeper(run_id, 60.0)
    ray.get(keeper.keep.remote("the lost driver's job"))
    ray.get(keeper.remember.remote({"shards": ["the run's"]}, "the lost driver's job"))
    return keeper


def test_of_two_drivers_taking_a_lost_drivers_run_over_together_only_the_first_gets_it(ray_cluster):
    keeper = _a_lost_drivers_run(uuid.uuid4().hex)
    try:
        # Both saw the lost driver go; the control point answers one at a time.
        asks = [keeper.take_over.remote(job, "the lost driver's job") for job in ("job A", "job B")]
        first, second = ray.get(asks)
        assert first == Takeover({"shards": ["the run's"]})
        assert second == Takeover(None, taken_by="job A")
        assert ray.get(keeper.driver_job.remote()) == "job A"
    finally:
        ray.kill(keeper)


def test_a_resume_whose_run_another_driver_took_while_it_waited_is_refused_naming_it(ray_cluster, tmp_path):
    run_id = uuid.uuid4().hex
    keeper = _a_lost_drivers_run(run_id)
    spec = validate_spec(blob_spec(tmp_path, training={"failure": {"driver_grace_s": 60}}))
    pool = ThreadPoolExecutor(1)
    resuming = pool.submit(take_over_live_run, run_id, spec, None)
    try:
        time.sleep(2)  # it has read the lost driver's job and waits for its lease to lapse (10 s)
        assert not resuming.done()
        assert ray.get(keeper.take_over.remote("job A", "the lost driver's job")).taken_by is None
        with pytest.raises(
            ClusterError, match=f"run {run_id} was taken over by another driver \\(Ray job job A\\)"
        ):
            resuming.result(timeout=60)
        assert ray.get(keeper.driver_job.remote()) == "job A"  # the run stays the first taker's
    finally:
        pool.shutdown(wait=False)
        ray.kill(keeper)


def test_a_taken_over_run_keeps_its_lease_from_the_take_over_on(ray_cluster, tmp_path):
    """Fencing, the workers' rest and the new driver's start take longer than a lease: the taker
    renews it from the take-over on, not from its driver's control point on, so that no second
    resume takes the run from it meanwhile (before, the lease lapsed after 10 s)."""
    import numpy as np

    from towerflow.runtime.protocol import AsyncProtocol
    from towerflow.runtime.ps import shard_actor
    from towerflow.runtime.run_keeper import Handover, compatibility

    run_id = uuid.uuid4().hex
    spec = validate_spec(blob_spec(tmp_path, training={"mode": "async", "failure": {"driver_grace_s": 60}}))
    keeper = _keeper(run_id, 60.0)
    shards = [shard_actor(0.1).remote(0)]
    live = None
    try:
        sgd = {"name": "sgd", "learning_rate": 1.0}
        ray.get(shards[0].load.remote(["w"], [np.zeros(2, np.float32)], sgd, AsyncProtocol(), None))
        handover = Handover(placement=None, shards=shards, shard_bundles=[0], compatible=compatibility(spec))
        ray.get(keeper.keep.remote("the lost driver's job"))
        ray.get(keeper.remember.remote(handover, "the lost driver's job"))
        live = take_over_live_run(run_id, spec, None)
        assert live is not None and live.global_step == 0
        time.sleep(LEASE_FRESH_S + 1)  # the new driver still starting: no control point of its own yet
        assert ray.get(keeper.driver_seen_s_ago.remote()) < LEASE_FRESH_S
    finally:
        if live is not None:
            live.control.let_go()
        for actor in (keeper, *shards):
            ray.kill(actor)
