"""Nodes about to go (`training.failure.memory_checkpoint_draining_s`).

A Ray node drains before it goes: a preempted or deleted pod's (on SIGTERM a node marks itself
draining, for up to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, before it stops), one that `ray
drain-node` names, one the autoscaler ends. It takes no new actors meanwhile, and goes at its
deadline with everything on it. A shard there cannot move before then: its placement group's
bundle stays on the draining node until the node is gone (Ray then moves the bundle, and the rollback
puts the new shard in it). So while a node holding a shard drains, the run keeps memory checkpoints
every few seconds instead of every `memory_checkpoint_every_s`: the shard's loss then redoes seconds
of steps, not up to that interval's. An elastic run's workers are not in placement groups: one on a
draining node is replaced ahead, by a spare that Ray starts elsewhere, in one resize (elastic.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from towerflow.runtime.placement import actor_node

log = logging.getLogger(__name__)
LOOK_EVERY_S = 1.0  # how often the driver asks Ray which nodes drain (a GCS call: 0.2 ms measured)


@dataclass(frozen=True)
class DrainNotice:
    """A draining node with shards or workers of the run on it."""

    node_id: str
    address: str | None
    shards: tuple[int, ...]
    deadline_in_s: float | None  # None: the drain named no deadline
    workers: tuple[int, ...] = ()

    def describe(self) -> str:
        deadline = (
            "no deadline" if self.deadline_in_s is None else f"its deadline in {self.deadline_in_s:.0f} s"
        )
        node = (
            f"node {self.address} (Ray node {self.node_id[:12]})"
            if self.address
            else f"Ray node {self.node_id[:12]}"
        )
        held = [
            f"{kind}(s) {', '.join(str(i) for i in ids)}"
            for kind, ids in (("shard", self.shards), ("worker", self.workers))
            if ids
        ]
        return f"{node} is draining ({deadline}) with {' and '.join(held)} on it"


class DrainWatch:
    """Which nodes holding the run's shards or workers are draining, looked at every `LOOK_EVERY_S`."""

    def __init__(
        self,
        draining_nodes: Callable[[], dict[str, int] | None] | None = None,
        node_of: Callable[[Any], str | None] = actor_node,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # () -> draining node id -> deadline; None: no answer yet (a BackgroundAnswer's, on the driver)
        self._draining_nodes = draining_nodes or ray_draining_nodes
        self._node_of = node_of
        self._clock = clock
        self._looked_at = -math.inf
        self._nodes: dict[bytes, str | None] = {}  # actor id -> its node (actors never move)
        self._told: set[str] = set()
        self.shards_draining = False  # as of the last look
        self.draining_workers: set[int] = set()  # worker ids, as of the last look

    def look(self, shards: Sequence[Any], workers: Mapping[int, Any] | None = None) -> list[DrainNotice]:
        """The draining nodes with shards or `workers` (id -> actor) on them not told of before (each
        is told once); updates `shards_draining` and `draining_workers`. A look Ray does not answer
        changes nothing: the training goes on."""
        now = self._clock()
        if now - self._looked_at < LOOK_EVERY_S:
            return []
        self._looked_at = now
        try:
            draining = self._draining_nodes()
            if draining is None:
                return []
            on_shards = self._on(draining, dict(enumerate(shards)))
            on_workers = self._on(draining, dict(workers or {}))
        except Exception as exc:  # monitoring must never stop training
            log.debug("could not ask Ray which nodes drain: %s", exc)
            return []
        self.shards_draining = any(on_shards.values())
        self.draining_workers = {worker for ids in on_workers.values() for worker in ids}
        notices = []
        for node in draining:
            if (on_shards[node] or on_workers[node]) and node not in self._told:
                self._told.add(node)
                deadline_ms = draining[node]
                left = max(0.0, deadline_ms / 1000 - time.time()) if deadline_ms else None
                notices.append(
                    DrainNotice(node, _address(node), tuple(on_shards[node]), left, tuple(on_workers[node]))
                )
        return notices

    def _on(self, draining: dict[str, int], actors: dict[int, Any]) -> dict[str, list[int]]:
        """Per draining node, the indices of `actors` on it."""
        on: dict[str, list[int]] = {node: [] for node in draining}
        if not on:  # no node drains: no actor's node is looked up
            return on
        for index, actor in actors.items():
            node = self._node(actor)
            if node in on:
                on[node].append(index)
        return on

    def _node(self, actor: Any) -> str | None:
        key = actor._actor_id.binary()
        if self._nodes.get(key) is None:
            self._nodes[key] = self._node_of(actor)
        return self._nodes[key]


def ray_draining_nodes() -> dict[str, int]:
    """Ray's draining nodes: node id (hex) -> deadline (ms since the epoch, 0: none), as Ray Data
    reads them (its scheduler avoids them)."""
    from ray._private.state import state

    return state.get_draining_nodes()


def _address(node_id: str) -> str | None:
    import ray

    try:
        return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)
    except Exception:  # only for the message
        return None
