"""Where the run's actors go: one placement group for the shards and the workers, its strategy
chosen by `cluster.placement` (SPREAD by default: over as many nodes as Ray can, so that losing a
node costs as few actors as it can; PACK to keep traffic within nodes; STRICT_ variants to insist).

The group reserves every bundle at once, so a run starts only when all its actors can, instead of
starting some and waiting for the rest. A replacement takes its predecessor's bundle (Ray moves a
lost node's bundles to live nodes). An elastic run reserves its shards only: a placement group
cannot grow or shrink, so its workers, which come and go with the cluster, are spread by Ray's SPREAD
scheduling strategy (or packed by its default one) instead.

Warm spare shards have bundles of their own, after the workers', and warm spare workers after
them; a spare that takes a lost actor's place keeps its bundle, and the next spare takes the lost
one's (runtime/spares.py). Shard-sized bundles are alike, so which are shards and which spares is
chosen once Ray has placed them: shards on as many nodes as they can, spares first where fewest
shards are, so that a node's loss takes a shard's spare with it as seldom as the layout allows.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import ray

from towerflow.errors import ClusterError

log = logging.getLogger(__name__)

STRATEGIES = {
    "spread": "SPREAD",
    "pack": "PACK",
    "strict_spread": "STRICT_SPREAD",
    "strict_pack": "STRICT_PACK",
}
_PROGRESS_EVERY_S = 30.0


class ActorPlacement:
    """The run's placement group, and the scheduling options of each shard and worker."""

    def __init__(self, cluster: Any, name: str) -> None:
        self.cluster = cluster  # the ClusterSpec
        self.name = name
        self.strategy = STRATEGIES[cluster.placement]
        self.shards = cluster.ps
        self.grouped_workers = 0 if cluster.elastic else cluster.workers
        worker = {
            "CPU": cluster.cpus_per_worker,
            **({"GPU": cluster.gpus_per_worker} if cluster.gpus_per_worker else {}),
        }
        self.spare_shards, self.spare_workers = cluster.spare_shards, cluster.spare_workers
        shard = {"CPU": cluster.cpus_per_ps}
        self.bundles = (
            [shard] * self.shards
            + [worker] * self.grouped_workers
            + [shard] * self.spare_shards
            + [worker] * self.spare_workers
        )
        # worker id -> its bundle; a spare that takes a worker's place brings its own
        self._worker_bundles = {i: self.shards + i for i in range(self.grouped_workers)}
        self.group: Any = None

    def reserve(self) -> None:
        """Create the placement group and wait until Ray has placed every bundle (a clear error after
        `cluster.placement_timeout_s`, naming what was asked)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        self.group = placement_group(self.bundles, strategy=self.strategy, name=self.name)
        started = time.monotonic()
        timeout = self.cluster.placement_timeout_s
        while not ray.wait([self.group.ready()], timeout=min(_PROGRESS_EVERY_S, timeout))[0]:
            waited = time.monotonic() - started
            if waited >= timeout:
                remove_placement_group(self.group)
                self.group = None
                raise ClusterError(
                    f"the Ray cluster could not place the run's {self.describe()} within "
                    f"{timeout:g} s (cluster.placement_timeout_s): add nodes, lower cluster.cpus_per_worker "
                    "/ cpus_per_ps, or choose another cluster.placement"
                )
            log.info("waiting for Ray to place the run's %s (%.0f s so far)", self.describe(), waited)

    def describe(self) -> str:
        worker = self.bundles[self.shards] if self.grouped_workers else None
        parts = [f"{self.shards} shard(s) of {self.cluster.cpus_per_ps:g} CPU"]
        if worker:
            parts.append(f"{self.grouped_workers} worker(s) of {_resources(worker)}")
        if self.spare_shards:
            parts.append(f"{self.spare_shards} spare shard(s)")
        if self.spare_workers:
            parts.append(f"{self.spare_workers} spare worker(s)")
        return f"{' and '.join(parts)} with placement {self.cluster.placement} ({self.strategy})"

    def shard_roles(self) -> tuple[list[int], list[int]]:
        """The bundles of the shards (by index) and of the warm spares (the one to take first
        first), as the run starts; see the module's docstring."""
        first_spare = self.shards + self.grouped_workers
        bundles = [*range(self.shards), *range(first_spare, first_spare + self.spare_shards)]
        if not self.spare_shards or self.group is None:
            return bundles[: self.shards], bundles[self.shards :]
        from ray.util import placement_group_table

        nodes = placement_group_table(self.group).get("bundles_to_node_id", {})
        return split_shard_roles({b: nodes.get(b) for b in bundles}, self.shards)

    def spare_worker_bundles(self) -> list[int]:
        """The bundles of the warm spare workers, as the run starts."""
        first = self.shards + self.grouped_workers + self.spare_shards
        return list(range(first, first + self.spare_workers))

    def move_worker(self, worker_id: int, bundle: int) -> int:
        """Worker `worker_id` (a spare taking its place) is in `bundle` now; returns the one it left."""
        left, self._worker_bundles[worker_id] = self._worker_bundles[worker_id], bundle
        return left

    def bundle_options(self, bundle: int) -> dict[str, Any]:
        """Scheduling options that place an actor in this bundle (none without a group)."""
        return self._bundle(bundle)

    def worker_options(self, worker_id: int) -> dict[str, Any]:
        """A worker of the starting set (and its replacements) takes its bundle; others (an elastic
        run's) are spread, or packed, by Ray's scheduler."""
        if self.holds_worker(worker_id):
            return self._bundle(self._worker_bundles[worker_id])
        return {"scheduling_strategy": "SPREAD"} if "SPREAD" in self.strategy else {}

    def holds_worker(self, worker_id: int) -> bool:
        """Whether this worker id (and its replacements) has a bundle of its own."""
        return self.group is not None and worker_id in self._worker_bundles

    def await_declared_dead(self, actor: Any, timeout_s: float = 120.0) -> None:
        """Wait until Ray has declared a lost actor dead, before its replacement takes the bundle.

        Ray declares a killed process dead at once, but an actor whose node died only once the
        node's health checks have failed; until then the bundle still points at that node, and a
        replacement placed there would die with it. After it, Ray moves the bundle to a live node."""
        if self.group is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if declared_dead(actor):
                return
            time.sleep(0.5)
        log.warning(
            "Ray has not declared actor %s dead after %.0f s; replacing it anyway",
            actor._actor_id.hex(),
            timeout_s,
        )

    def release(self) -> None:
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None

    def _bundle(self, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.group is None:
            return {}
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=index
            )
        }


def split_shard_roles(node_of: dict[int, Any], shards: int) -> tuple[list[int], list[int]]:
    """Of the shard-sized bundles `node_of` (bundle -> its node), `shards` for the shards, each taken
    where the fewest shards are so far (ties: the lowest bundle), and the rest for spares, those on
    nodes with fewest shards first."""
    on_node: Counter[Any] = Counter()
    left = sorted(node_of)
    chosen = []
    for _ in range(shards):
        bundle = min(left, key=lambda b: (on_node[node_of[b]], b))
        chosen.append(bundle)
        on_node[node_of[bundle]] += 1
        left.remove(bundle)
    return chosen, sorted(left, key=lambda b: (on_node[node_of[b]], b))


def declared_dead(actor: Any) -> bool:
    """Whether Ray has declared this actor dead (its bundle, if it had one, free to take)."""
    from ray._private.state import actors

    return actors(actor_id=actor._actor_id.hex()).get("State") == "DEAD"


def _resources(bundle: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in bundle.items())
