"""The run's placement group as laid out (runtime/placement.py): which bundle holds which actor.
Reserving it on a real cluster is tested in test_multinode_cluster.py."""

import pytest

from towerflow.runtime.placement import ActorPlacement, split_shard_roles
from towerflow.spec.schema import ClusterSpec


@pytest.mark.parametrize(
    ("cluster", "shards", "spares", "bundles"),
    [
        ({"workers": 2, "ps": 2}, [0, 1], [], 4),
        # spares come after the workers, so a worker's bundle stays shards + its id
        ({"workers": 2, "ps": 2, "spare_shards": 1}, [0, 1], [4], 5),
        # an elastic run's workers are outside the group: the spares follow the shards
        ({"workers": {"min": 1, "max": 3}, "ps": 1, "spare_shards": 2}, [0], [1, 2], 3),
    ],
)
def test_spare_shards_have_bundles_of_their_own_after_the_workers(cluster, shards, spares, bundles):
    placement = ActorPlacement(ClusterSpec(cpus_per_worker=1, cpus_per_ps=0.25, **cluster), "probe")
    assert placement.shard_roles() == (shards, spares)  # before placement: in bundle order
    assert len(placement.bundles) == bundles
    assert all(placement.bundles[b] == {"CPU": 0.25} for b in shards + spares)
    if spares:
        assert placement.describe().startswith(f"{len(shards)} shard(s) of 0.25 CPU")
        assert f"{len(spares)} spare shard(s)" in placement.describe()
    if not ClusterSpec(**cluster).elastic:
        assert "2 worker(s) of 1 CPU" in placement.describe()


@pytest.mark.parametrize(
    ("node_of", "shards", "roles"),
    [
        # every bundle on a node of its own: the bundle order stands
        ({0: "a", 1: "b", 4: "c"}, 2, ([0, 1], [4])),
        # Ray put shard bundles 0 and 1 on one node: a shard moves to 4's node, the spare sits beside
        # the other shard (one shard a node, and no node without one)
        ({0: "a", 1: "a", 4: "b"}, 2, ([0, 4], [1])),
        # a spare on a node with no shard is taken first
        ({0: "a", 1: "b", 4: "a", 5: "c"}, 2, ([0, 1], [5, 4])),
        ({0: None, 1: None, 2: None}, 1, ([0], [1, 2])),  # nodes unknown: the bundle order
    ],
)
def test_shards_spread_first_and_spares_go_where_fewest_shards_are(node_of, shards, roles):
    assert split_shard_roles(node_of, shards) == roles


def test_a_spare_worker_that_takes_a_workers_id_brings_its_bundle():
    cluster = ClusterSpec(
        workers=2, ps=2, spare_shards=1, spare_workers=1, cpus_per_worker=1, cpus_per_ps=0.25
    )
    placement = ActorPlacement(cluster, "probe")
    assert placement.spare_worker_bundles() == [5]  # after the spare shard's
    assert placement.bundles[5] == {"CPU": 1}
    assert "1 spare worker(s)" in placement.describe()
    assert placement.move_worker(1, 5) == 3  # worker 1 left shards + 1 for the spare's
    assert placement.move_worker(1, 3) == 5  # and the next spare, started in 3, takes it back
