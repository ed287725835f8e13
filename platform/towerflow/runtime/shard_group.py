"""The parameter-server shards as one group: start them, lay the model's variables out over them,
load them (from the model's initial values or a checkpoint, all at one version), find the lost
ones and put new ones in their places."""

from __future__ import annotations

import contextlib
from typing import Any

import ray

from towerflow.runtime.failure import ActorLoss, LossKind
from towerflow.runtime.protocol import make_protocol
from towerflow.runtime.ps import shard_actor
from towerflow.runtime.pushes import Placement
from towerflow.runtime.sharding import cut_variables, gradient_buckets, make_sharding, shard_variables
from towerflow.runtime.worker_group import ACTOR_GONE


class ShardGroup:
    def __init__(self, spec: Any, apply_threads: int | None) -> None:
        self.spec = spec
        self.apply_threads = apply_threads  # sync shards borrow the waiting workers' cores to apply
        self.actors: list[Any] = []
        self.variables: list[Any] = []  # VariableInfo, in model order
        self.pieces: list[Any] = []  # variables or row slices of them
        self.assignment: list[list[int]] = []  # piece indices per shard
        self.buckets: list[list[int]] = []  # per shard, per piece: its gradient bucket
        self.initial_values: list[Any] | None = None  # the model's, for a rollback with no checkpoint

    def start(self) -> None:
        """Start every shard (each imports TensorFlow); they get their pieces with `load`."""
        self.actors = [self._new(index) for index in range(self.spec.cluster.ps)]

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
        last_step: int | None,
        snapshot_every: int | None,
        workers: int,
        replicas: int,
    ) -> list[Any]:
        """Give every shard its pieces at `version`: from `state` (a TrainingState), else from the
        model's initial values, for `workers` workers of which sync steps aggregate `replicas`.
        Returns the load calls' refs. A shard loaded again starts afresh."""
        spec, pieces, assignment = self.spec, self.pieces, self.assignment
        optimizer = spec.training.optimizer.model_dump(mode="json")
        if state is not None:
            from towerflow.checkpoint import split_for_shards

            initial = split_for_shards(state, self.variables, pieces, assignment, optimizer["name"])
        else:
            values = self.initial_values
            initial = [
                ([pieces[i].of(values[pieces[i].variable]) for i in indices], None) for indices in assignment
            ]
        bounds = [b for b in (spec.training.max_steps, last_step) if b is not None]
        protocol = make_protocol(
            spec.training.mode,
            replicas_to_aggregate=replicas,
            total_num_replicas=workers,
            max_staleness=spec.training.max_staleness,
        )
        return [
            self.actors[shard].load.remote(
                [pieces[i].name for i in indices],
                shard_values,
                optimizer,
                protocol,
                min(bounds) if bounds else None,
                initial_slots=shard_slots,
                initial_version=version,
                snapshot_every=snapshot_every,
                buckets=self.buckets[shard],
            )
            for shard, (indices, (shard_values, shard_slots)) in enumerate(zip(assignment, initial))
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

    def lost(self, at_step: int) -> list[ActorLoss]:
        """The shards that do not answer (a worker's call to one failed)."""
        found = []
        for index, shard in enumerate(self.actors):
            try:
                ray.get(shard.ping.remote(), timeout=30)
            except (ray.exceptions.GetTimeoutError, *ACTOR_GONE) as exc:
                cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
                found.append(ActorLoss(LossKind.SHARD, index, at_step, cause))
        return found

    def replace(self, index: int) -> None:
        """A new shard in the place of shard `index` (load it before use)."""
        with contextlib.suppress(Exception):
            ray.kill(self.actors[index])
        self.actors[index] = self._new(index)

    def finish(self) -> list[Any]:
        """Stop every shard accepting gradients and release the workers waiting on it."""
        return [shard.finish.remote() for shard in self.actors]

    def kill(self) -> None:
        for shard in self.actors:
            with contextlib.suppress(Exception):  # already dead is fine
                ray.kill(shard)
        self.actors = []

    def _new(self, index: int) -> Any:
        cpus = self.spec.cluster.cpus_per_ps
        return shard_actor(cpus).remote(index, cpus, apply_threads=self.apply_threads)
