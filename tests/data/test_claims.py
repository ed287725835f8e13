"""Data pipelines' claims on the cluster's cores (data/claims.py): recorded while a split coordinator
reads, forgotten at its close, and withdrawn by the next pipeline's start when the coordinator
died without closing (as with its killed driver), where Ray Data would keep the claim 180 s.
(With a driver SIGKILLed on a multi-node cluster:
tests/runtime/test_multinode_driver_loss.py::test_a_driver_lost_with_its_control_point_is_continued_by_resume_auto_from_its_live_shards.)"""

from __future__ import annotations

import time

import pytest
from support import ray_data_claims

pytestmark = pytest.mark.timeout(180)


def _pipeline(ray):
    from towerflow.data.splits import resumable_streaming_split

    ds = ray.data.range(4000, override_num_blocks=40).map_batches(lambda b: b)
    return resumable_streaming_split(ds, 2, equal=False, prestart=True)


def _claim_of(ray, splits, timeout: float = 60) -> tuple[str, str]:
    """(coordinator name, requester) once the prestarted execution's claim is on record and known
    to Ray Data's autoscaling coordinator."""
    from towerflow.data import claims

    name = ray.get(splits[0].coordinator.__ray_call__.remote(lambda self: self._name))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        requester = claims.recorded().get(name)
        if requester and requester in ray_data_claims(ray):
            return name, requester
        time.sleep(0.2)
    raise TimeoutError(f"no claim of {name} within {timeout:.0f} s: {claims.recorded()}")


def test_a_reading_coordinator_records_its_claim_and_its_close_forgets_it(ray_cluster):
    from towerflow.data import claims

    splits = _pipeline(ray_cluster)
    name, requester = _claim_of(ray_cluster, splits)
    ray_cluster.get(splits[0].close())
    assert name not in claims.recorded()
    assert requester not in ray_data_claims(ray_cluster)  # the execution's shutdown withdrew it


def test_a_claim_whose_coordinator_died_is_withdrawn_when_the_next_pipeline_starts(ray_cluster):
    from towerflow.data import claims

    splits = _pipeline(ray_cluster)
    name, requester = _claim_of(ray_cluster, splits)
    ray_cluster.kill(splits[0].coordinator)  # its process ends as with its driver: no shutdown
    deadline = time.monotonic() + 30
    while claims._alive(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert requester in ray_data_claims(ray_cluster)  # left alone, Ray Data keeps it 180 s
    following = _pipeline(ray_cluster)
    assert requester not in ray_data_claims(ray_cluster)
    assert name not in claims.recorded()
    ray_cluster.get(following[0].close())


def test_a_live_coordinators_claim_is_left_alone(ray_cluster):
    from towerflow.data import claims

    splits = _pipeline(ray_cluster)
    name, requester = _claim_of(ray_cluster, splits)
    assert requester not in claims.withdraw_orphaned()
    assert claims.recorded()[name] == requester and requester in ray_data_claims(ray_cluster)
    ray_cluster.get(splits[0].close())
