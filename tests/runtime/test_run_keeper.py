"""Where a lost driver's live shards stand, and whether a new driver may go on from them, on real
shard actors."""

from types import SimpleNamespace

import numpy as np
import ray

from towerflow.runtime.protocol import AsyncProtocol, SyncProtocol
from towerflow.runtime.ps import shard_actor
from towerflow.runtime.run_keeper import Handover, _where_they_stand


def _loaded_shards(protocol, loading: int) -> list:
    shards = [shard_actor(0.1).remote(i) for i in range(2)]
    sgd = {"name": "sgd", "learning_rate": 1.0}
    ray.get(
        [
            s.load.remote([f"w{i}"], [np.zeros(2, np.float32)], sgd, protocol, None, loading=loading)
            for i, s in enumerate(shards)
        ]
    )
    return shards


def _standing(shards: list, mode: str) -> str | None:
    handover = Handover(placement=None, shards=shards, shard_bundles=[0, 1])
    return _where_they_stand(handover, SimpleNamespace(training=SimpleNamespace(mode=mode)))[1]


def test_async_shards_far_apart_are_taken_over_where_one_load_gave_them_their_state(ray_cluster):
    shards = _loaded_shards(AsyncProtocol(max_staleness=1), loading=7)
    try:
        one = [np.ones(2, np.float32)]
        for version in range(5):  # shard 1 applies five late gradients shard 0 dropped: drift
            ray.get(shards[1].push.remote(one, version, 0))
        assert [ray.get(s.ping.remote()) for s in shards] == [0, 5]
        assert _standing(shards, "async") is None
        # A load its driver left half done: shard 0 got the rollback's, shard 1 did not.
        sgd = {"name": "sgd", "learning_rate": 1.0}
        ray.get(
            shards[0].load.remote(["w0"], [np.zeros(2, np.float32)], sgd, AsyncProtocol(), None, loading=8)
        )
        assert "not all given the same load" in _standing(shards, "async")
    finally:
        for shard in shards:
            ray.kill(shard)


def test_sync_shards_more_than_a_step_apart_are_not_taken_over(ray_cluster):
    shards = _loaded_shards(SyncProtocol(replicas_to_aggregate=1, total_num_replicas=1), loading=3)
    try:
        ray.get(shards[1].join.remote(0, 0))
        one = [np.ones(2, np.float32)]
        ray.get(shards[1].push.remote(one, 0, 0))
        assert _standing(shards, "sync") is None  # a step's pushes under way: one step apart
        ray.get(shards[1].push.remote(one, 1, 0))
        assert "too far apart" in _standing(shards, "sync")
    finally:
        for shard in shards:
            ray.kill(shard)


def test_shards_not_loaded_for_their_run_are_not_taken_over(ray_cluster):
    """Made for a run whose driver was lost before it loaded them (a fresh shard's answer crashed
    every resume before)."""
    shards = [shard_actor(0.1).remote(i) for i in range(2)]
    try:
        assert "were not loaded yet" in _standing(shards, "sync")
    finally:
        for shard in shards:
            ray.kill(shard)
