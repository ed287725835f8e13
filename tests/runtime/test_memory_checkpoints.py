"""Memory checkpoints' bookkeeping (runtime/memory_checkpoints.py); a rollback to one, with a shard
killed for real, is in test_faults.py."""

from __future__ import annotations

from towerflow.runtime.memory_checkpoints import MemoryCheckpoint, MemoryCheckpoints


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_shards_part_is_held_by_the_next_in_a_ring():
    kept = MemoryCheckpoint(global_step=7, examples_seen=0, shards=3)
    assert [kept.holder(s) for s in range(3)] == [1, 2, 0]
    assert kept.restores([1]) and kept.restores([0])
    assert not kept.restores([1, 2])  # shard 2 held shard 1's part
    assert kept.restores([0, 2]) is False  # shard 0 held shard 2's
    two = MemoryCheckpoint(global_step=7, examples_seen=0, shards=2)
    assert two.restores([1]) and not two.restores([0, 1])


def test_one_falls_due_every_interval_with_two_shards_or_more_and_never_when_off():
    clock = Clock()
    memory = MemoryCheckpoints(30.0, clock=clock)
    assert not memory.due(2)  # the interval runs from the start
    clock.now += 30
    assert memory.due(2)
    assert not memory.due(1)  # no peer to hold a copy
    assert not MemoryCheckpoints(None, clock=clock).due(4)
    memory.forget()
    assert memory.latest is None
