"""Where the run's actors go: placement groups for the shards and the workers, their strategy
chosen by `cluster.placement` (SPREAD by default: over as many nodes as Ray can, so that losing a
node costs as few actors as it can; PACK to keep traffic within nodes; STRICT_ variants to insist).

Ray's SPREAD places a group's biggest bundles first, each on a node of its own while any is left,
and stacks the rest on the node with most room: in one group with the workers, every shard landed on
one node (every node a worker's, the shards on the last). Under SPREAD the shard-sized bundles are a
group of their own, reserved after the workers' (as Ray's own order would: the big bundles, a GPU
worker's most of all, take their nodes first, and no shard can take room a worker needs), so the
shards spread over the nodes left with room among themselves (a node's loss costs one shard, and
each shard's traffic has a node's network to itself); the other strategies keep one group, since
they state a rule for all the run's actors together.

The groups reserve every bundle at once, so a run starts only when all its actors can, instead of
starting some and waiting for the rest. A replacement takes its predecessor's bundle (Ray moves a
lost node's bundles to live nodes). An elastic run reserves its shards only: a placement group
cannot grow or shrink, so its workers, which come and go with the cluster, are spread by Ray's SPREAD
scheduling strategy (or packed by its default one) instead.

Bundles are numbered across the groups: shards, workers, spare shards, spare workers. Warm spares
have bundles of their own; a spare that takes a lost actor's place keeps its bundle, and the next
spare takes the lost one's (runtime/spares.py). Bundles of one size are alike, so which are shards
and which spares is chosen once Ray has placed them (and likewise workers and theirs): shards on as
many nodes as they can, workers where fewest shards and workers are, spares first where fewest of
the actors they stand in for are, so that a node's loss takes a spare with what it stands in for as
seldom as the layout allows (a warning says when it would every time).
"""

from __future__ import annotations

import concurrent.futures
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

# How long a lost actor's replacement waits for Ray to declare it dead before taking its bundle
# anyway (a lost node's: once its health checks have failed, 5 of them 3 s apart by default).
DECLARED_DEAD_WAIT_S = 120.0


class ActorPlacement:
    """The run's placement groups, and the scheduling options of each shard and worker."""

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
        # The roles in bundle order until Ray has placed the group (`reserve` chooses them then):
        first_spare_shard = self.shards + self.grouped_workers
        self._shard_bundles = list(range(self.shards))
        self._spare_shard_bundles = list(range(first_spare_shard, first_spare_shard + self.spare_shards))
        # worker id -> its bundle; a spare that takes a worker's place brings its own
        self._worker_bundles = {i: self.shards + i for i in range(self.grouped_workers)}
        first_spare_worker = first_spare_shard + self.spare_shards
        self._spare_worker_bundles = list(range(first_spare_worker, first_spare_worker + self.spare_workers))
        # the bundles of each size, whose roles `choose_roles` may swap among them
        self._shard_sized = self._shard_bundles + self._spare_shard_bundles
        self._worker_sized = sorted(self._worker_bundles.values()) + self._spare_worker_bundles
        # The bundles (by number) of each placement group, in its order, and its name.
        if self.strategy == "SPREAD" and self._worker_sized:
            self._parts = {f"{name}-workers": self._worker_sized, f"{name}-shards": self._shard_sized}
        else:
            self._parts = {name: list(range(len(self.bundles)))}
        self._where = {b: (g, i) for g, part in enumerate(self._parts.values()) for i, b in enumerate(part)}
        self.groups: list[Any] = []
        self.detached = False  # the groups outlive the driver: a kept run's (runtime/run_keeper.py)

    def shape(self) -> tuple[Any, ...]:
        """What another run's placement must equal for its actors to take this one's bundles
        (runtime/actor_pool.py): the strategy, and each role's bundles."""
        counts = (self.shards, self.grouped_workers, self.spare_shards, self.spare_workers)
        return self.strategy, counts, tuple(tuple(sorted(b.items())) for b in self.bundles)

    def reserved_resources(self) -> dict[str, float]:
        """What the bundles reserve, all together (the shards', workers' and spares')."""
        held: dict[str, float] = {}
        for bundle in self.bundles:
            for resource, amount in bundle.items():
                held[resource] = held.get(resource, 0.0) + amount
        return held

    def group_names(self) -> tuple[str, ...]:
        """The names of the run's placement groups (made by `reserve`)."""
        return tuple(self._parts)

    def reserve(self) -> None:
        """Create the placement groups and wait until Ray has placed every bundle (a clear error after
        `cluster.placement_timeout_s`, naming what was asked)."""
        from ray.util.placement_group import placement_group

        self.groups = [  # created in order: Ray places them so, each with the room the ones before left
            placement_group(
                [self.bundles[b] for b in part],
                strategy=self.strategy,
                name=group_name,
                lifetime="detached" if self.detached else None,
            )
            for group_name, part in self._parts.items()
        ]
        started = time.monotonic()
        timeout = self.cluster.placement_timeout_s
        readies = [group.ready() for group in self.groups]
        while len(
            ray.wait(readies, num_returns=len(readies), timeout=min(_PROGRESS_EVERY_S, timeout))[0]
        ) < len(readies):
            waited = time.monotonic() - started
            if waited >= timeout:
                self.release()
                raise ClusterError(
                    f"the Ray cluster could not place the run's {self.describe()} within "
                    f"{timeout:g} s (cluster.placement_timeout_s): add nodes, lower cluster.cpus_per_worker "
                    "/ cpus_per_ps, or choose another cluster.placement"
                )
            log.info("waiting for Ray to place the run's %s (%.0f s so far)", self.describe(), waited)
        if self.spare_shards or self.spare_workers:
            self.choose_roles(self.node_of())

    def node_of(self) -> dict[int, Any]:
        """Each bundle's node (by bundle number), as Ray has placed them."""
        from ray.util import placement_group_table

        nodes = [placement_group_table(group).get("bundles_to_node_id", {}) for group in self.groups]
        return {b: nodes[g].get(i) for b, (g, i) in self._where.items()} if self.groups else {}

    def choose_roles(self, node_of: dict[int, Any]) -> None:
        """Which bundles hold shards, workers and the spares of each, from where Ray placed them
        (`node_of`: bundle -> its node); see the module's docstring."""
        self._shard_bundles, self._spare_shard_bundles = split_roles(
            {b: node_of.get(b) for b in self._shard_sized}, self.shards
        )
        beside = Counter(node_of.get(b) for b in self._shard_bundles)
        members, self._spare_worker_bundles = split_roles(
            {b: node_of.get(b) for b in self._worker_sized}, self.grouped_workers, beside
        )
        self._worker_bundles = dict(enumerate(members))
        _warn_of_spares_beside(node_of, self._shard_bundles, self._spare_shard_bundles, "shard")
        _warn_of_spares_beside(node_of, members, self._spare_worker_bundles, "worker")

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
        """The bundles of the shards (by index) and of the warm spare shards (the one to take first
        first), as the run starts."""
        return list(self._shard_bundles), list(self._spare_shard_bundles)

    def spare_shard_bundles(self, shard_bundles: list[int]) -> list[int]:
        """The bundles of shard size that the shards in `shard_bundles` do not hold: their spares'."""
        return [b for b in self._shard_sized if b not in shard_bundles]

    def spare_worker_bundles(self) -> list[int]:
        """The bundles of the warm spare workers (the one to take first first): those of worker size
        that no worker holds (after a spare took a lost one's place, that one's bundle too)."""
        held = set(self._worker_bundles.values())
        first = [b for b in self._spare_worker_bundles if b not in held]
        return first + [b for b in self._worker_sized if b not in held and b not in first]

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
        return bool(self.groups) and worker_id in self._worker_bundles

    def await_declared_dead(self, actor: Any, timeout_s: float = DECLARED_DEAD_WAIT_S) -> None:
        """Wait until Ray has declared a lost actor dead, before its replacement takes the bundle.

        Ray declares a killed process dead at once, but an actor whose node died only once the
        node's health checks have failed; until then the bundle still points at that node, and a
        replacement placed there would die with it. After it, Ray moves the bundle to a live node."""
        if not self.groups:
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
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self.groups = []

    def _bundle(self, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not self.groups:
            return {}
        group, local = self._where[index]
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[group], placement_group_bundle_index=local
            )
        }


def split_roles(
    node_of: dict[int, Any], members: int, beside: Counter[Any] | None = None
) -> tuple[list[int], list[int]]:
    """Of the alike bundles `node_of` (bundle -> its node), `members` for the members, each taken
    where the fewest actors are so far (`beside`: other actors per node, counted too; ties: the
    lowest bundle), and the rest for spares, those on nodes with fewest actors first."""
    on_node: Counter[Any] = Counter(beside or {})
    left = sorted(node_of)
    chosen = []
    for _ in range(members):
        bundle = min(left, key=lambda b: (on_node[node_of[b]], b))
        chosen.append(bundle)
        on_node[node_of[bundle]] += 1
        left.remove(bundle)
    return chosen, sorted(left, key=lambda b: (on_node[node_of[b]], b))


def _warn_of_spares_beside(node_of: dict[int, Any], members: list[int], spares: list[int], kind: str) -> None:
    """Spares on the one node every member is on stand in for none of them when a node is lost
    (the node takes them all): said where the group spans nodes, so that some other layout could."""
    if not spares or len(set(node_of.values())) < 2:
        return
    if len({node_of.get(b) for b in members + spares}) == 1:
        log.warning(
            "Ray placed every %s and spare %s on one node of the several the run spans: that node's "
            "loss takes the spares too, and new actors start instead (cluster.placement "
            "strict_spread, with a node for every bundle, keeps them apart)",
            kind,
            kind,
        )


def declared_dead(actor: Any) -> bool:
    """Whether Ray has declared this actor dead (its bundle, if it had one, free to take)."""
    return _actor_record(actor).get("State") == "DEAD"


def ask_node(actor: Any) -> Any:
    """Ask `actor` where it runs, without waiting for the answer (`actor_node` reads it); returns
    the actor. Asked as an actor is made, the answer comes as its start ends, before it is busy
    (a worker's calls can fill its threads for as long as a resize takes)."""
    key = actor._actor_id.hex()
    if key not in _actor_nodes and key not in _asked:
        _asked[key] = actor.__ray_call__.remote(_own_node).future()
    return actor


def actor_node(actor: Any) -> str | None:
    """The node an actor runs on, as the actor itself said: a direct call, with no GCS on the way (a
    lost head's would hold the asker up until it is back: runtime/head_watch.py). Never waits:
    None until the actor has answered `ask_node` (asked here if it was not), or where it is gone.
    Kept once known: the run's shards and workers are never restarted, so never move."""
    key = actor._actor_id.hex()
    if key in _actor_nodes:
        return _actor_nodes[key]
    ask_node(actor)
    answer = _asked[key]
    if not answer.done():
        return None
    del _asked[key]  # answered: kept below, or asked again next time (an actor gone says nothing)
    if answer.exception() is not None:
        return None
    _actor_nodes[key] = answer.result()
    return _actor_nodes[key]


def _own_node(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


_actor_nodes: dict[str, str] = {}  # actor id -> its node, once known
_asked: dict[str, concurrent.futures.Future] = {}  # actor id -> its answer to come


def _actor_record(actor: Any) -> dict[str, Any]:
    from ray._private.state import actors

    return actors(actor_id=actor._actor_id.hex())


def _resources(bundle: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in bundle.items())
