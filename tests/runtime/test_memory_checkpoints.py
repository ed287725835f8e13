"""Memory checkpoints' bookkeeping (runtime/memory_checkpoints.py); a rollback to one, with a shard
killed for real, is in test_faults.py."""

from __future__ import annotations

import logging

from towerflow.runtime.memory_checkpoints import MemoryCheckpoint, MemoryCheckpoints, peer_ring
from towerflow.runtime.shard_group import ShardGroup


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def restores(kept: MemoryCheckpoint, lost: list[int], dead: set[str] = frozenset()) -> bool:
    """As a rollback asks, with the actors named: shard s is "s<s>"; `dead`: other actors gone."""
    return kept.restores(lost, lambda holder: holder not in {f"s{s}" for s in lost} | dead)


def test_a_checkpoint_restores_lost_shards_only_where_their_holders_live():
    kept = MemoryCheckpoint(global_step=7, examples_seen=0, holders=("s1", "s2", "s0"))
    assert [kept.holder(s) for s in range(3)] == ["s1", "s2", "s0"]
    assert restores(kept, [1]) and restores(kept, [0])
    assert not restores(kept, [1, 2])  # shard 2 held shard 1's part
    assert not restores(kept, [0, 2])  # shard 0 held shard 2's
    two = MemoryCheckpoint(global_step=7, examples_seen=0, holders=("s1", "s0"))
    assert restores(two, [1]) and not restores(two, [0, 1])
    # One shard, its copy held by a warm spare: restored while the spare lives.
    one = MemoryCheckpoint(global_step=7, examples_seen=0, holders=("spare",))
    assert restores(one, [0]) and not restores(one, [0], dead={"spare"})


def test_one_falls_due_every_interval_and_never_when_off():
    clock = Clock()
    memory = MemoryCheckpoints(30.0, clock=clock)
    assert not memory.due()  # the interval runs from the start
    clock.now += 30
    assert memory.due()
    assert not MemoryCheckpoints(None, clock=clock).due()
    memory.forget()
    assert memory.latest is None


def test_while_a_node_holding_a_shard_drains_they_fall_due_every_draining_interval():
    clock = Clock()
    memory = MemoryCheckpoints(30.0, draining_every_s=2.0, clock=clock)
    clock.now += 2
    assert not memory.due()
    memory.draining = True
    assert memory.due()
    memory.draining = False  # the node went, or drains no more
    assert not memory.due()
    off = MemoryCheckpoints(None, draining_every_s=2.0, clock=clock)
    off.draining = True  # memory checkpoints off: still taken while a shard's node drains
    clock.now += 2
    assert off.due()


def holders_on_their_own_node(nodes: list, holders: list[int]) -> list[int]:
    return [s for s, h in enumerate(holders) if nodes[s] == nodes[h]]


def test_each_shards_copy_goes_to_another_node_where_there_is_one():
    for nodes in (["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a", "a", "b", "c"], ["x", "y"]):
        holders = peer_ring(nodes)
        assert sorted(holders) == list(range(len(nodes)))  # a ring: each holds one copy
        assert all(h != s for s, h in enumerate(holders))
        assert holders_on_their_own_node(nodes, holders) == [], (nodes, holders)
    # More shards on one node than on all the others: some copies stay beside their shard.
    nodes = ["a", "a", "a", "b"]
    assert len(holders_on_their_own_node(nodes, peer_ring(nodes))) == 2
    # Unknown nodes (no placement group): the shards in order.
    assert peer_ring([None, None, None]) == [1, 2, 0]


class Placed:
    """Where Ray placed the run's bundles (bundle -> node), as ActorPlacement.node_of reads them."""

    def __init__(self, node_of: dict[int, str]) -> None:
        self._node_of = node_of

    def node_of(self) -> dict[int, str]:
        return self._node_of


def _shards_in(bundles: list[int], node_of: dict[int, str]) -> ShardGroup:
    """Shards in `bundles` (each shard stands for its bundle's number here)."""
    group = ShardGroup(spec=None, apply_threads=None, placement=Placed(node_of), node_of=node_of.get)
    group.actors = group._bundles = bundles  # as start() takes them from the placement's roles
    return group


def test_copies_held_beside_their_shards_on_a_cluster_of_several_nodes_are_warned_of_once(caplog):
    packed = _shards_in([0, 1], {0: "a", 1: "a", 2: "b"})  # both shards on a; a worker on b
    with caplog.at_level(logging.WARNING, logger="towerflow.runtime.shard_group"):
        assert packed.peer_holders() == [1, 0]
        assert packed.peer_holders() == [1, 0]
    (warning,) = caplog.records
    assert "shard(s) [0, 1]" in warning.getMessage() and "stored checkpoint" in warning.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="towerflow.runtime.shard_group"):
        assert _shards_in([0, 1], {0: "a", 1: "b", 2: "b"}).peer_holders() == [1, 0]  # spread
        assert _shards_in([0, 1], {0: "a", 1: "a", 2: "a"}).peer_holders() == [1, 0]  # one node
    assert not caplog.records
