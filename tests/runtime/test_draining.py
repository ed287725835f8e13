"""DrainWatch: which nodes holding the run's shards drain, each told of once (the real drain, on the
multi-node cluster, is test_multinode_draining.py's)."""

from __future__ import annotations

import time

from towerflow.runtime.draining import LOOK_EVERY_S, DrainWatch


class Shard:
    """A shard's handle as the watch reads it: its actor id."""

    def __init__(self, name: str) -> None:
        self._actor_id = self
        self.name = name

    def binary(self) -> bytes:
        return self.name.encode()


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_draining_node_with_shards_is_told_of_once_and_hurries_until_it_goes():
    nodes = {"s0": "n1", "s1": "n2", "s2": "n2"}
    draining: dict[str, int] = {}
    clock, asked = Clock(), []

    def node_of(shard):
        asked.append(shard.name)
        return nodes[shard.name]

    watch = DrainWatch(lambda: dict(draining), node_of, clock)
    shards = [Shard(name) for name in nodes]
    assert watch.look(shards) == [] and not watch.shards_draining and asked == []  # nothing drains
    draining["n2"] = int(time.time() * 1000) + 30_000
    draining["n9"] = 0  # a node without shards
    assert watch.look(shards) == []  # looked at a moment ago: not asked again yet
    clock.now += LOOK_EVERY_S
    (notice,) = watch.look(shards)
    assert (notice.node_id, notice.shards) == ("n2", (1, 2)) and 28 <= notice.deadline_in_s <= 30
    assert (
        "is draining (its deadline in" in notice.describe()
        and "with shard(s) 1, 2 on it" in notice.describe()
    )
    assert watch.shards_draining
    clock.now += LOOK_EVERY_S
    assert watch.look(shards) == [] and watch.shards_draining  # told once; still draining
    assert sorted(asked) == ["s0", "s1", "s2"]  # each shard's node looked up once
    del draining["n2"]  # it went: its shards are new ones elsewhere
    clock.now += LOOK_EVERY_S
    assert watch.look([Shard("s0")]) == [] and not watch.shards_draining


def test_a_look_that_ray_does_not_answer_changes_nothing():
    def fails():
        raise ConnectionError("GCS away")

    watch = DrainWatch(fails, lambda shard: "n1", Clock())
    assert watch.look([Shard("s0")]) == [] and not watch.shards_draining


def test_workers_on_a_draining_node_are_told_of_with_its_shards():
    nodes = {"s0": "n1", "w0": "n1", "w1": "n2", "w2": "n1"}
    watch = DrainWatch(lambda: {"n1": 0}, lambda actor: nodes[actor.name], Clock())
    workers = {0: Shard("w0"), 1: Shard("w1"), 2: Shard("w2")}
    (notice,) = watch.look([Shard("s0")], workers)
    assert (notice.shards, notice.workers, notice.deadline_in_s) == ((0,), (0, 2), None)
    assert notice.describe().endswith("is draining (no deadline) with shard(s) 0 and worker(s) 0, 2 on it")
    assert watch.draining_workers == {0, 2} and watch.shards_draining
