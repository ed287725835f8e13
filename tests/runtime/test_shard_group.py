"""The shards as a group (runtime/shard_group.py) with warm spares, on the session's Ray: which
process takes a lost shard's place, and how the spares are made good again. A whole run with a spare
is in test_faults.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from support import blob_spec

from towerflow.runtime import shard_group
from towerflow.runtime.placement import ActorPlacement
from towerflow.runtime.shard_group import FIRST_WAIT_S, ShardGroup, ShardLook, look_at
from towerflow.spec import validate_spec

pytestmark = pytest.mark.timeout(180)


def _kill(actor) -> int:
    pid = ray.get(actor.pid.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


def _refilled(group: ShardGroup, spares: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(group.spares.spares) < spares and time.monotonic() < deadline:
        group.spares.refill()  # the driver's every turn
        time.sleep(0.2)
    assert len(group.spares.spares) == spares


def _made_good(group: ShardGroup, lost_spare, timeout_s: float = 60.0) -> None:
    """Until another spare stands in `lost_spare`'s place (refill asks each spare whether it lives)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        group.spares.refill()  # the driver's every turn
        if [a for a, _ in group.spares.spares if a is not lost_spare]:
            return
        time.sleep(0.2)
    raise AssertionError(f"no spare in the lost one's place: {group.spares.spares}")


def test_a_spare_takes_a_lost_shards_place_and_a_lost_spare_is_made_good(ray_cluster, tmp_path):
    spec = validate_spec(
        blob_spec(tmp_path, cluster={"workers": 1, "ps": 1, "spare_shards": 1, "cpus_per_worker": 0.5})
    )
    placement = ActorPlacement(spec.cluster, "test-shard-group")
    placement.reserve()
    group = ShardGroup(spec, None, placement)
    try:
        group.start()
        (spare, spare_bundle), shard = group.spares.spares[0], group.actors[0]
        assert spare_bundle == 2  # after the shard's and the worker's
        spare_pid = ray.get(spare.pid.remote())

        lost_pid = _kill(shard)
        assert group.replace([0]) == [0]  # the spare took the place, in its own bundle
        assert ray.get(group.actors[0].pid.remote()) == spare_pid
        _refilled(group, 1)  # a new spare, in the lost shard's bundle once Ray freed it
        new_spare, bundle = group.spares.spares[0]
        assert bundle == 0  # (one node: the roles keep the bundle order)
        assert ray.get(new_spare.pid.remote()) not in (spare_pid, lost_pid)

        dead_spare_pid = _kill(new_spare)  # a spare lost while it waits: found by the pool's calls
        _made_good(group, new_spare)
        ((made_good, bundle),) = group.spares.spares
        assert bundle == 0 and ray.get(made_good.pid.remote()) != dead_spare_pid

        dead_spare_pid = _kill(made_good)  # lost right before it is needed: found dead then
        lost_pid = _kill(group.actors[0])
        assert group.replace([0]) == []  # a new shard instead
        assert ray.get(group.actors[0].pid.remote()) not in (dead_spare_pid, lost_pid)
        _refilled(group, 1)  # the dead spare's bundle gets a spare again
    finally:
        group.kill()
        placement.release()
    assert group.spares.spares == [] and group.actors == []


@ray.remote(num_cpus=0)
class _Pingable:
    """Answers pings as a loaded shard does (`ParameterShard.ping`: its version)."""

    def ping(self) -> int:
        return 3

    def pid(self) -> int:
        return os.getpid()


def test_a_look_leaves_a_silent_shard_unjudged_while_the_gcs_is_silent_and_finds_it_hung_once_it_answers(
    ray_cluster, monkeypatch
):
    """A shard that answers no ping is hung (lost) only where the GCS answered meanwhile: a ping to a
    live shard may wait for a lost head's return, and the driver's loop must not wait with it."""
    shards = [_Pingable.remote(), _Pingable.remote()]
    _, silent_pid = ray.get([shard.pid.remote() for shard in shards])
    stopped = False
    try:
        assert look_at(shards, 7, lambda since: False) == ShardLook([], [])  # every one answers
        os.kill(silent_pid, signal.SIGSTOP)  # alive, and answers nothing
        stopped = True

        started = time.monotonic()
        look = look_at(shards, 7, lambda since: False)  # the GCS silent too
        assert look == ShardLook([], [1]) and time.monotonic() - started < FIRST_WAIT_S + 3

        monkeypatch.setattr(shard_group, "HUNG_AFTER_S", FIRST_WAIT_S + 2)
        look = look_at(shards, 8, lambda since: True)  # the GCS there: hung, so lost
        assert look.unanswered == [] and [(loss.index, loss.at_step) for loss in look.lost] == [(1, 8)]
    finally:
        if stopped:
            os.kill(silent_pid, signal.SIGCONT)
        for shard in shards:
            ray.kill(shard)
