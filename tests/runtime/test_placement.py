"""The run's placement groups as laid out (runtime/placement.py): which bundle holds which actor.
Reserving it on a real cluster is tested in test_multinode_cluster.py."""

import logging
from collections import Counter

import pytest

from towerflow.runtime.placement import ActorPlacement, split_roles
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
    assert split_roles(node_of, shards) == roles


def test_workers_go_where_fewest_shards_and_workers_are_and_their_spare_where_fewest_are_left():
    # shard bundles 0, 1 on nodes a, b; worker bundles 2 (a), 3 (c); the spare worker's 4 (c)
    node_of = {0: "a", 1: "b", 2: "a", 3: "c", 4: "c"}
    assert split_roles({2: "a", 3: "c", 4: "c"}, 2, Counter({"a": 1, "b": 1})) == ([3, 2], [4])
    placement = ActorPlacement(
        ClusterSpec(workers=2, ps=2, spare_workers=1, cpus_per_worker=1, cpus_per_ps=0.25), "probe"
    )
    placement.choose_roles(node_of)
    assert placement.shard_roles() == ([0, 1], [])
    assert placement.spare_worker_bundles() == [4]
    # worker 0 on c, where no shard is; worker 1 on a (a and c hold an actor each by then: the lower bundle)
    assert placement.move_worker(0, 4) == 3 and placement.move_worker(1, 3) == 2


@pytest.mark.parametrize(
    ("node_of", "warned"),
    [
        # every shard-sized bundle on node a, the run spanning a and b: the spare stands in for none
        ({0: "a", 1: "a", 2: "b", 3: "b", 4: "a"}, True),
        ({0: "a", 1: "b", 2: "a", 3: "b", 4: "a"}, False),  # the spare stands in for shard 1
        ({0: "a", 1: "a", 2: "a", 3: "a", 4: "a"}, False),  # one node: no layout would do better
    ],
)
def test_spares_on_the_one_node_of_every_member_are_warned_of(node_of, warned, caplog):
    placement = ActorPlacement(
        ClusterSpec(workers=2, ps=2, spare_shards=1, cpus_per_worker=1, cpus_per_ps=0.25), "probe"
    )
    with caplog.at_level(logging.WARNING, logger="towerflow.runtime.placement"):
        placement.choose_roles(node_of)
    assert ("every shard and spare shard on one node" in caplog.text) is warned
    assert placement.shard_roles() == ([0, 1], [4])


def test_a_spare_worker_that_takes_a_workers_id_brings_its_bundle():
    cluster = ClusterSpec(
        workers=2, ps=2, spare_shards=1, spare_workers=1, cpus_per_worker=1, cpus_per_ps=0.25
    )
    placement = ActorPlacement(cluster, "probe")
    assert placement.spare_worker_bundles() == [5]  # after the spare shard's
    assert placement.bundles[5] == {"CPU": 1}
    assert "1 spare worker(s)" in placement.describe()
    assert placement.move_worker(1, 5) == 3  # worker 1 left shards + 1 for the spare's
    # the bundle it left is the spares' now (a driver taking the run over starts its spare there)
    assert placement.spare_worker_bundles() == [3]
    assert placement.move_worker(1, 3) == 5  # and the next spare, started in 3, takes it back
    assert placement.spare_worker_bundles() == [5]
