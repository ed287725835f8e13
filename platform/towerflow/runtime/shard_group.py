"""The parameter-server shards as one group: start them, lay the model's variables out over them,
load them (from the model's initial values or a checkpoint, all at one version), find the lost
ones and put others in their places: a warm spare where one is ready (`cluster.spare_shards`), else
a new shard."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from towerflow.checkpoint.files import PartLayout, shard_part_name
from towerflow.checkpoint.stores import StoredCheckpoint
from towerflow.errors import ClusterError
from towerflow.runtime.actor_pool import KEPT_ANSWER_S
from towerflow.runtime.actors import ACTOR_GONE, first_line, kill_quietly
from towerflow.runtime.failure import ActorLoss, LossKind
from towerflow.runtime.memory_checkpoints import MemoryCheckpoint, peer_ring
from towerflow.runtime.placement import actor_node, ask_node
from towerflow.runtime.protocol import make_protocol
from towerflow.runtime.ps import shard_actor
from towerflow.runtime.pushes import Placement
from towerflow.runtime.run_keeper import Handover, LiveRun
from towerflow.runtime.shard_parts import LiveState, OwnCopy, PartSource
from towerflow.runtime.sharding import cut_variables, gradient_buckets, make_sharding, shard_variables
from towerflow.runtime.spares import SparePool

log = logging.getLogger(__name__)
# A shard's ping answers in milliseconds. Longer than the GCS watcher's look (every second): by
# then it has answered since the pings went out, where the GCS is there.
FIRST_WAIT_S = 2.0
HUNG_AFTER_S = 30.0  # a shard that answers no ping this long, the GCS there, is hung: lost


@dataclass(frozen=True)
class ShardLook:
    """The shards' answers to a look (`ShardGroup.look`): those lost, and those not answered while
    the GCS was silent, which are judged at a later look."""

    lost: list[ActorLoss]
    unanswered: list[int]


class ShardGroup:
    def __init__(
        self,
        spec: Any,
        apply_threads: int | None,
        placement: Any,
        node_of: Callable[[Any], str | None] = actor_node,
    ) -> None:
        self.spec = spec
        self.actor_placement = placement  # ActorPlacement: each shard's bundle
        self._node_of = node_of  # an actor -> its node
        self.apply_threads = apply_threads  # sync shards borrow the waiting workers' cores to apply
        self.actors: list[Any] = []
        self.variables: list[Any] = []  # VariableInfo, in model order
        self.pieces: list[Any] = []  # variables or row slices of them
        self.assignment: list[list[int]] = []  # piece indices per shard
        self.buckets: list[list[int]] = []  # per shard, per piece: its gradient bucket
        self.initial_values: list[Any] | None = None  # the model's, for a rollback with no checkpoint
        self._bundles: list[int] = []  # per shard, its bundle (numbered across the run's placement groups)
        self._warned_of_copies_beside = False
        self._nodes_looked_at: list[str | None] | None = None  # the shards' nodes, as peer_holders last saw
        self._replaced: set[int] = set()  # shards put in others' places since the last load: hold nothing
        self.detached = False  # the shards outlive the driver: a kept run's (runtime/run_keeper.py)
        self.term = 0  # the driver's, which the shards' loads and finishes carry (runtime/fencing.py)
        # cluster.spare_shards; a shard's start is a TensorFlow import: 15 s is a loaded node's
        self.spares = SparePool(lambda bundle: self._new(None, bundle), "shard", answer_timeout_s=15.0)

    def start(self) -> None:
        """Start every shard and spare (each imports TensorFlow); shards get their pieces with `load`."""
        self._bundles, spare_bundles = self.actor_placement.shard_roles()
        self.actors = [self._new(index, bundle) for index, bundle in enumerate(self._bundles)]
        self.spares.start(spare_bundles)

    def reuse(self, shards: list[Any], bundles: list[int]) -> None:
        """Take a finished run's kept shards (runtime/actor_pool.py) in their bundles, each reset for
        this run; one that does not answer ends, and a new one starts in its bundle, as new ones do
        in the bundles of those that ended (`shards` shorter than `bundles`). Spares start in the
        other shard-sized bundles."""
        self._bundles = list(bundles)
        resets = [shard.reset.remote(index) for index, shard in enumerate(shards)]
        self.actors = []
        for index, (shard, reset) in enumerate(zip(shards, resets, strict=True)):
            try:
                ray.get(reset, timeout=KEPT_ANSWER_S)
                self.actors.append(ask_node(shard))
            except (*ACTOR_GONE, ray.exceptions.GetTimeoutError):
                kill_quietly(shard)
                self.actors.append(self._new(index, bundles[index]))
        self.actors += [self._new(index, bundles[index]) for index in range(len(self.actors), len(bundles))]
        self.spares.start(self.actor_placement.spare_shard_bundles(self._bundles))

    def adopt(self, handover: Handover) -> None:
        """Take over the live shards of a run whose driver was lost (runtime/run_keeper.py); its
        spare shards end, and new ones start in their bundles."""
        self.actors, self._bundles = list(handover.shards), list(handover.shard_bundles)
        for shard in self.actors:
            ask_node(shard)
        for spare in handover.spares:
            kill_quietly(spare)
        self.spares.start(self.actor_placement.spare_shard_bundles(self._bundles))

    @property
    def bundles(self) -> list[int]:
        """Per shard, its bundle."""
        return list(self._bundles)

    def handover(self, compatible: dict[str, Any]) -> Handover:
        """What a driver taking these shards over needs."""
        spares = [actor for actor, _ in self.spares.spares]
        return Handover(self.actor_placement, list(self.actors), list(self._bundles), spares, compatible)

    def lay_out(self, variables: list[Any], push_bucket_bytes: int | None) -> None:
        """Cut the variables into pieces, place them on the shards, and bucket their gradients."""
        cluster = self.spec.cluster
        pieces = cut_variables(variables, cluster.ps, cluster.min_slice_bytes)
        assignment = shard_variables(make_sharding(cluster.sharding), pieces, cluster.ps)
        bucket_of = {
            variable: bucket
            for bucket, members in enumerate(gradient_buckets(variables, push_bucket_bytes))
            for variable in members
        }
        self.variables, self.pieces, self.assignment = variables, pieces, assignment
        self.buckets = [[bucket_of[pieces[i].variable] for i in indices] for indices in assignment]

    def load(
        self,
        state: Any,
        version: int,
        *,
        final_step: int | None,
        snapshot_every: int | None,
        workers: int,
        replicas: int,
        rollback: bool = False,
        examples_seen: int = 0,
    ) -> None:
        """Give every shard its pieces at `version` and wait until all have them: from `state` (a
        StoredCheckpoint, a whole TrainingState or a MemoryCheckpoint), else from the model's initial values, for
        `workers` workers of which sync steps aggregate `replicas`, the data read from `examples_seen`
        on; from what each holds, for a LiveRun state (runtime/run_keeper.py). A checkpoint laid
        out as these shards are is read by each shard itself, part by part; any other is re-cut
        here. A shard loaded again starts afresh."""
        spec = self.spec
        optimizer = spec.training.optimizer.model_dump(mode="json")
        initial = self._initial_pieces(state, optimizer["name"], rollback)
        protocol = make_protocol(
            spec.training.mode,
            replicas_to_aggregate=replicas,
            total_num_replicas=workers,
            max_staleness=spec.training.max_staleness,
        )

        loading = secrets.randbits(62)  # one number for this load's shards: a half-done one shows

        def load(shard: int, values: Any, slots: Any) -> Any:
            return self.actors[shard].load.remote(
                [self.pieces[i].name for i in self.assignment[shard]],
                values,
                optimizer,
                protocol,
                final_step,
                initial_slots=slots,
                initial_version=version,
                snapshot_every=snapshot_every,
                buckets=self.buckets[shard],
                shard_id=shard,
                examples_seen=examples_seen,
                term=self.term,
                loading=loading,
            )

        self._replaced = set()
        loaded = ray.get([load(shard, values, slots) for shard, (values, slots) in enumerate(initial)])
        for shard, done in enumerate(loaded):
            if not done:  # its node cannot reach the checkpoint store: the driver reads its part for it
                source = initial[shard][0]
                log.info(
                    "shard %d cannot reach the checkpoint store: its part goes through the driver", shard
                )
                values, slots = source.checkpoint.read_part(source.part, source.with_slots)
                named = dict(zip(source.checkpoint.slot_names, slots)) if source.with_slots else None
                ray.get(load(shard, values, named))

    def _initial_pieces(self, state: Any, optimizer: str, rollback: bool) -> list[tuple[Any, Any]]:
        """Per shard: (values or a PartSource, slots or None)."""
        pieces, assignment = self.pieces, self.assignment
        if isinstance(state, LiveRun):
            return [(LiveState(), None) for _ in assignment]
        if isinstance(state, MemoryCheckpoint):  # a rollback: each its own copy, a new shard its peer's
            version = state.global_step
            return [
                (
                    state.holder(s).peer_copy.remote(s, version) if s in self._replaced else OwnCopy(version),
                    None,
                )
                for s in range(len(assignment))
            ]
        if state is None:
            values = self.initial_values
            return [
                ([pieces[i].of(values[pieces[i].variable]) for i in indices], None) for indices in assignment
            ]
        if isinstance(state, StoredCheckpoint) and self._laid_out_as(state):
            with_slots = state.optimizer == optimizer
            return [
                (PartSource(state, shard_part_name(s), with_slots, own_copy_ok=rollback), None)
                for s in range(len(assignment))
            ]
        from towerflow.checkpoint import split_for_shards

        if isinstance(state, StoredCheckpoint):
            log.info("the checkpoint of step %d has another shard layout: re-cutting it", state.global_step)
            state = state.read()
        return split_for_shards(state, self.variables, pieces, assignment, optimizer)

    def _laid_out_as(self, checkpoint: Any) -> bool:
        """Whether the checkpoint's parts are exactly these shards' pieces of these variables."""
        shapes = {v["name"]: tuple(v["shape"]) for v in checkpoint.meta["variables"]}
        if shapes != {info.name: tuple(info.shape) for info in self.variables}:
            return False  # re-cutting it says what differs
        return sorted(checkpoint.parts, key=lambda part: part.name) == self.part_layouts()

    def part_layouts(self) -> list[PartLayout]:
        """Per shard, the part of a checkpoint it writes: rows of which variable, in its order."""
        return [
            PartLayout(
                shard_part_name(shard),
                tuple(
                    (self.variables[self.pieces[i].variable].name, self.pieces[i].start, self.pieces[i].stop)
                    for i in indices
                ),
            )
            for shard, indices in enumerate(self.assignment)
        ]

    def placement(self) -> Placement:
        """Per shard, its pieces as (variable, start row, stop row, whole variable?) for the workers."""
        infos, pieces = self.variables, self.pieces
        return [
            [
                (
                    pieces[i].variable,
                    pieces[i].start,
                    pieces[i].stop,
                    pieces[i].covers(infos[pieces[i].variable]),
                )
                for i in shard
            ]
            for shard in self.assignment
        ]

    def memory_holders(self, workers: Sequence[Any] = ()) -> list[Any]:
        """Per shard, the actor to hold a copy of its part of a memory checkpoint: another shard
        (`peer_holders`), or, with one shard, the first warm spare (the one a loss takes first,
        which then loads its own copy), else one of `workers` (the run's worker actors, in the
        order to prefer them), the first on another node than the shard's where one is; none
        where there is none of these."""
        if len(self.actors) >= 2:
            return [self.actors[holder] for holder in self.peer_holders()]
        if self.actors and self.spares.spares:
            return [self.spares.spares[0][0]]
        if self.actors and workers:
            shard_node = self._node_of(self.actors[0])
            elsewhere = (worker for worker in workers if self._node_of(worker) not in (shard_node, None))
            return [next(elsewhere, workers[0])]
        return []

    def holder_lives(self, holder: Any, lost: list[int]) -> bool:
        """Whether a memory checkpoint's holder can give its copy back after shards `lost` were
        lost: a shard not among them (the loss check asked them all), or a spare shard or a
        worker that answers."""
        if holder._actor_id in {self.actors[index]._actor_id for index in lost}:
            return False
        if any(holder._actor_id == shard._actor_id for shard in self.actors):
            return True
        try:
            ray.get(holder.__ray_ready__.remote(), timeout=10)
        except (ray.exceptions.GetTimeoutError, *ACTOR_GONE):
            return False
        return True

    def peer_holders(self) -> list[int]:
        """Per shard, the shard that holds a copy of its part of a memory checkpoint: on another node
        wherever the shards' placement allows (`peer_ring`). Warns once where it does not, on a
        cluster of several nodes: that node's loss goes back to the stored checkpoint."""
        nodes = [self._node_of(shard) for shard in self.actors]  # asked of the shards, not of the GCS
        holders = peer_ring(nodes)
        beside = [s for s, h in enumerate(holders) if nodes[s] is not None and nodes[s] == nodes[h]]
        if not beside or self._warned_of_copies_beside or nodes == self._nodes_looked_at:
            return holders
        self._nodes_looked_at = nodes  # the run's bundles' nodes, asked of the GCS once per placement
        if len(set(self.actor_placement.node_of().values()) - {None}) > 1:
            self._warned_of_copies_beside = True
            log.warning(
                "memory checkpoints: the copies of shard(s) %s are held on their own node (the shards' "
                "placement leaves no other): that node's loss rolls back to the stored checkpoint",
                beside,
            )
        return holders

    def look(self, at_step: int, gcs_answered_after: Callable[[float], bool]) -> ShardLook:
        """Ping every shard (a worker's call to one failed, or a worker was lost): `look_at`."""
        return look_at(self.actors, at_step, gcs_answered_after)

    def replace(self, indices: list[int], attempts: int = 3) -> list[int]:
        """Other shards in the places of shards `indices`, started (load them before use): a warm
        spare where one answers, else a new shard. Returns the indices a spare took.

        Killing a lost one makes Ray declare it dead at once, also where its node is dying but not
        yet declared dead; its bundle then still points at that node, and a shard placed there dies
        unstarted once the node is declared dead, after which Ray moves the bundle: hence attempts.
        A spare keeps its own bundle, so it need not wait for that; the bundles it frees get new
        spares at the driver's next turn (`spares.refill`, runtime/spares.py)."""
        for index in indices:
            kill_quietly(self.actors[index])
        self._replaced.update(indices)
        by_spare = []
        for index in indices:
            spare = self.spares.take()
            if spare is None:
                break
            self.spares.free(self.actors[index], self._bundles[index])
            self.actors[index], self._bundles[index] = spare
            by_spare.append(index)
            log.info("a warm spare takes shard %d's place", index)
        indices = [index for index in indices if index not in by_spare]
        for index in indices:
            self.actor_placement.await_declared_dead(self.actors[index])
        for attempt in range(attempts):
            if not indices:
                break
            for index in indices:
                self.actors[index] = self._new(index, self._bundles[index])
            indices = self._died_starting(indices, last_attempt=attempt == attempts - 1)
        return by_spare

    def _died_starting(self, indices: list[int], *, last_attempt: bool) -> list[int]:
        """Of the new shards `indices`, those that died as they started (raised on the last attempt).
        One that no node has room for (its bundle not placed again) fails the run after
        `training.failure.start_timeout_s`, as a worker's replacement counts as lost then, rather
        than hold the driver for ever."""
        timeout_s = self.spec.training.failure.start_timeout_s
        deadline = time.monotonic() + timeout_s
        started = [self.actors[index].__ray_ready__.remote() for index in indices]
        died = []
        for index, ref in zip(indices, started):
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"shard {index}'s replacement did not start within {timeout_s:g} s "
                    "(training.failure.start_timeout_s): no node has room for it "
                    f"({self.spec.cluster.cpus_per_ps:g} CPU, cluster.cpus_per_ps); the run goes on "
                    "from its newest checkpoint with --resume once the cluster has room"
                ) from None
            except ACTOR_GONE as exc:
                if last_attempt:
                    raise
                died.append(index)
                log.info(
                    "shard %d's replacement died as it started (%s): placing another", index, first_line(exc)
                )
        return died

    def finish(self) -> list[Any]:
        """Stop every shard accepting gradients and release the workers waiting on it; the refs of
        their answers (`RunTakenOver` where another driver has the shards now)."""
        return [shard.finish.remote(term=self.term) for shard in self.actors]

    def settle_at(self, version: int) -> list[Any]:
        """Every finished shard takes `version` as its last (`ParameterShard.settle_at`); the refs."""
        return [shard.settle_at.remote(version, term=self.term) for shard in self.actors]

    def kill(self) -> None:
        for shard in self.actors:
            kill_quietly(shard)
        self.actors = []
        self.spares.kill()

    def _new(self, index: int | None, bundle: int) -> Any:
        """A shard actor in this bundle; `index` None: a spare."""
        cpus = self.spec.cluster.cpus_per_ps
        lifetime = {"lifetime": "detached"} if self.detached else {}
        actor = shard_actor(cpus).options(**self.actor_placement.bundle_options(bundle), **lifetime)
        return ask_node(actor.remote(index, cpus, apply_threads=self.apply_threads))


def look_at(shards: Sequence[Any], at_step: int, gcs_answered_after: Callable[[float], bool]) -> ShardLook:
    """Ping every one of `shards` (a worker's call to one failed, or a worker was lost). A failed ping is a
    lost shard; one not answered within `FIRST_WAIT_S` is waited for up to `HUNG_AFTER_S` (then
    lost: hung) where the GCS answered since the pings went out (`gcs_answered_after`, its
    watcher's clock: monotonic). Where it did not, the look ends there and the silent shards
    are left unanswered, to be asked again: a ping to a live shard on a live node may wait for
    a lost head's return (seen: answered once the new GCS was), and the driver's loop must not."""
    sent = time.monotonic()
    pings = [shard.ping.remote() for shard in shards]  # all at once: a hung one costs 30 s once
    lost, unanswered = [], []
    for index, ping in enumerate(pings):
        try:
            try:
                ray.get(ping, timeout=max(0.0, sent + FIRST_WAIT_S - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                if not gcs_answered_after(sent):
                    unanswered.append(index)
                    continue
                ray.get(ping, timeout=max(0.0, sent + HUNG_AFTER_S - time.monotonic()))
        except (ray.exceptions.GetTimeoutError, *ACTOR_GONE) as exc:
            lost.append(ActorLoss(LossKind.SHARD, index, at_step, first_line(exc)))
    return ShardLook(lost, unanswered)
