"""The run's actors (mixed into the Driver): creating the shards and workers, loading the shards,
and each worker's configuration, a replacement's or a spare's too.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from towerflow.runtime.actor_pool import KEPT_ACTORS, KEPT_ANSWER_S, IdleActors, ReuseKey
from towerflow.runtime.actors import ACTOR_GONE, kill_quietly
from towerflow.runtime.placement import ask_node
from towerflow.runtime.ps import shard_tf_config
from towerflow.runtime.run_keeper import LiveRun, compatibility
from towerflow.runtime.worker import worker_actor
from towerflow.runtime.worker_config import WorkerConfig, worker_config

log = logging.getLogger(__name__)


class RunActors:
    """For the Driver, which provides the spec, the session, the placement, the shard and worker
    groups, the elastic policy and the protocol these read."""

    def _create_actors(self, count: int) -> None:
        session = self.session
        live = self.initial_state if isinstance(self.initial_state, LiveRun) else None
        idle = self._idle
        if live is not None:  # a lost driver's shards, in their placement groups, taken over
            self.actor_placement = self.shard_group.actor_placement = live.handover.placement
        elif idle is not None:  # the last run's, in this process (`_take_idle_actors`)
            if idle.keeper is not None:  # this run's control point keeps them beyond the driver now
                self.control.keep()
                idle.keeper.close()
        else:
            kept = self._kept_beyond_the_driver()
            self.actor_placement.detached = self.shard_group.detached = kept
            self.actor_placement.reserve()  # every shard and worker placed at once, as cluster.placement asks
            if kept:
                self.control.keep()
        self._start_steps = {i: self._worker_config(i).start_at_step for i in range(count)}
        taken = self._take_kept_workers(live.workers if live is not None else {}, count)
        if idle is not None:
            self._rebuild_idle_workers(idle.workers, count)
        self.group.start([i for i in range(count) if i not in self.group.slots])
        self.worker_spares.start(self.actor_placement.spare_worker_bundles())  # beside the workers
        # The shards start (import TensorFlow) while worker 0 builds the model; they get their
        # pieces once its variables are known.
        if live is not None:
            self.shard_group.adopt(live.handover)
        elif idle is not None:
            self.shard_group.reuse(idle.shards, idle.shard_bundles)
        else:
            self.shard_group.start()
        self._keep_handover_current()
        infos, values = ray.get(self.workers[0].describe.remote())
        self.shard_group.lay_out(infos, self._push_bucket_bytes())
        group = self.shard_group
        session.variables, session.pieces, session.shard_assignment = (
            group.variables,
            group.pieces,
            group.assignment,
        )
        if self._stored_start() is None:
            group.initial_values = values  # a rollback with no checkpoint yet starts over from these
        self._load_shards(self.initial_state, session.start_step)
        # Wait until every actor has started (TensorFlow imported, model built, pieces loaded)
        # before the clock runs.
        ray.get([w.devices_used.remote() for w in self.workers])
        self._load_starting_model_state(taken)
        for _ in range(self.elastic.target - count):  # Ray starts them as room appears
            self.group.request_spare()
        if self.elastic.elastic:
            session.log_metrics({"workers": float(count)}, session.start_step)

    def _take_kept_workers(self, kept: dict[int, Any], count: int) -> list[Any]:
        """A lost driver's workers, at rest (runtime/run_keeper.py), take their ids again under
        this driver's worker config; those beyond `count`, or built for another (a changed
        `data.train.label`, say), end, and new workers start in their places. Returns the actors
        taken."""
        asked = {
            worker_id: worker.actor.assume.remote(self._worker_config(worker_id))
            for worker_id, worker in kept.items()
            if worker_id < count
        }
        taken = []
        for worker_id, worker in sorted(kept.items()):
            try:
                assumed = worker_id in asked and ray.get(asked[worker_id])
            except ACTOR_GONE:
                assumed = False
            if assumed:
                self.group.take_over(worker_id, ask_node(worker.actor), worker.last_run)
                taken.append(worker.actor)
            else:
                kill_quietly(worker.actor)  # a new worker takes its bundle once Ray frees it
        if taken:
            log.info("worker(s) %s of the lost driver train on", sorted(self.group.slots))
        return taken

    def _take_idle_actors(self) -> IdleActors | None:
        """The actors the last run in this process kept, where they fit this run: their placement
        becomes this run's (before its control point, which names the placement groups it keeps);
        else None, any kept actors ended."""
        if isinstance(self.initial_state, LiveRun):
            return None  # a lost driver's actors are this run's (and are not kept at its end)
        self._reuse = self._reuse_key()  # at the run's end too, for the actors it keeps
        idle = KEPT_ACTORS.take(self._reuse)
        if idle is not None:
            self.actor_placement = self.shard_group.actor_placement = idle.placement
            self.shard_group.detached = idle.placement.detached
        return idle

    def _rebuild_idle_workers(self, idle: dict[int, Any], count: int) -> None:
        """A finished run's kept workers (runtime/actor_pool.py) take their ids again, each built
        anew under this run's config; one that fails to (gone, paused, or its build raised) ends,
        and a new worker starts in its bundle (one whose build raises says so as it starts)."""
        asked = {i: worker.rebuild.remote(self._worker_config(i)) for i, worker in idle.items() if i < count}
        for worker_id, worker in sorted(idle.items()):
            try:
                rebuilt = worker_id in asked and ray.get(asked[worker_id], timeout=KEPT_ANSWER_S)
            except ray.exceptions.RayError:
                rebuilt = False
            if rebuilt:
                self.group.take_over(worker_id, ask_node(worker), last_run=0)
            else:
                kill_quietly(worker)

    def _reuse_key(self) -> ReuseKey | None:
        """What this run's actors are made for (runtime/actor_pool.py): the placement's shape,
        whether they outlive a lost driver (a tracked run's do), each role's TensorFlow set-up;
        None for an elastic run, whose workers have no bundles."""
        if self.elastic.elastic:
            return None
        shard_tf = shard_tf_config(self.spec.cluster.cpus_per_ps, self._apply_threads())
        return ReuseKey(
            placement=self.actor_placement.shape(),
            beyond_the_driver=self._kept_beyond_the_driver(),
            shards=shard_tf.settings(),
            workers=self._worker_config(0).tf.settings(),
        )

    def _load_starting_model_state(self, taken: list[Any]) -> None:
        """Give the new workers the run's non-trainable state: the kept workers', averaged (theirs
        is the newest; they keep their own), else the state the run resumed from."""
        fresh = [w for w in self.workers if all(w is not kept for kept in taken)]
        if not fresh:
            return
        if taken:
            state = self._averaged_model_state([w.model_state.remote() for w in taken], timeout_s=30)
        else:
            state = self.initial_state.model_state if self.initial_state is not None else {}
        if state:
            ray.get([w.load_model_state.remote(state) for w in fresh])

    def _load_shards(self, state: Any, version: int, *, rollback: bool = False) -> None:
        session, workers = self.session, len(self.group.slots)
        self.shard_group.load(
            state,
            version,
            final_step=session.final_step,
            snapshot_every=session.snapshot_every,
            workers=workers,
            replicas=self.elastic.replicas_to_aggregate(workers),
            rollback=rollback,
            examples_seen=self.aggregator.examples_seen,  # where the data starts (`_count_from`)
        )

    def _stored_start(self) -> Any:
        """The stored state the run started from (a resume's checkpoint), or None: the model's own."""
        state = self.initial_state
        return state.stored if isinstance(state, LiveRun) else state

    def _kept_beyond_the_driver(self) -> bool:
        """Whether this run's shards outlive a lost driver (`training.failure.driver_grace_s`): a
        tracked run's, which a driver can resume; a run that took a lost driver's over."""
        if isinstance(self.initial_state, LiveRun):
            return True
        return bool(self.session.tags.get("run_id")) and self.spec.training.failure.driver_grace_s is not None

    def _keep_handover_current(self) -> None:
        """Tell a kept run's control point of its shards and spares whenever they change."""
        if self.control is None or not self._kept_beyond_the_driver():
            return
        workers = {i: s.actor for i, s in self.group.slots.items() if self._kept_worker(i) and not s.lost}
        spare_workers = [actor for actor, _ in self.worker_spares.spares]
        actors = [*self.shards, *(a for a, _ in self.shard_group.spares.spares), *spare_workers]
        now = tuple(a._actor_id for a in actors) + tuple((i, a._actor_id) for i, a in workers.items())
        if now != self._handed_over:
            self._handed_over = now
            handover = self.shard_group.handover(compatibility(self.spec))
            handover.workers, handover.spare_workers = workers, spare_workers
            self.control.remember(handover)

    def _kept_worker(self, worker_id: int) -> bool:
        """Whether this worker id's actors outlive a lost driver: a kept run's, in a bundle of its
        placement groups (an elastic run's are not: their removal would not end them)."""
        return self.actor_placement.detached and self.actor_placement.holds_worker(worker_id)

    @property
    def shards(self) -> list[Any]:
        """The shard actors, by index."""
        return self.shard_group.actors

    def _push_bucket_bytes(self) -> int | None:
        """Push gradients in buckets during backprop only where it pays: sync mode, where every
        worker waits for the update, and no clipping, whose norm needs the whole gradient first."""
        training = self.spec.training
        if not self.protocol.lockstep or training.optimizer.clip_global_norm is not None:
            return None
        return self.spec.cluster.push_bucket_bytes

    def _apply_threads(self) -> int | None:
        """Sync workers wait while the shards apply: lend the shards their cores meanwhile."""
        cluster = self.spec.cluster
        if not self.protocol.lockstep:
            return None
        return max(1, int(cluster.workers * cluster.cpus_per_worker // cluster.ps))

    def _worker_config(self, worker_id: int) -> WorkerConfig:
        return worker_config(
            self.spec,
            worker_id,
            feature_scales=self.feature_scales,
            start_step=self.session.start_step,
            faults=self.faults,
            push_in_buckets=bool(self._push_bucket_bytes()),
        )

    def _idless_worker_config(self) -> WorkerConfig:
        """A worker's config under no worker id (-1): no start delay, no profile (a warm spare's, which
        `assume` replaces; the evaluator's)."""
        config = self._worker_config(0)
        config.worker_id, config.start_at_step, config.profile_steps = -1, 0, None
        return config

    def _new_worker(self, worker_id: int, spare: bool = False) -> Any:
        """A worker actor (a replacement too: its GlobalStepWaiter step has passed, it starts at once).
        A spare, as it starts, readies its node for the read tasks of the pipeline it will join."""
        cluster = self.spec.cluster
        config = self._worker_config(worker_id)
        if spare:
            config.ready_node_for_reading = self._ready_node_for_reading
        actor = worker_actor(cluster.cpus_per_worker, cluster.gpus_per_worker)
        lifetime = {"lifetime": "detached"} if self._kept_worker(worker_id) else {}
        return ask_node(
            actor.options(**self.actor_placement.worker_options(worker_id), **lifetime).remote(config)
        )

    def _new_spare_worker(self, bundle: int) -> Any:
        """A warm spare worker in this bundle, with no id yet: it takes a lost one's (`assume`)."""
        cluster = self.spec.cluster
        actor = worker_actor(cluster.cpus_per_worker, cluster.gpus_per_worker)
        lifetime = {"lifetime": "detached"} if self.actor_placement.detached else {}
        return ask_node(
            actor.options(**self.actor_placement.bundle_options(bundle), **lifetime).remote(
                self._idless_worker_config()
            )
        )

    def _replacement_for(self, worker_id: int) -> Any:
        """A warm spare that has taken lost worker `worker_id`'s id and bundle (the lost one's bundle
        gets the next spare: no wait for Ray); None when no spare answers, once the lost one's
        bundle is free for a new actor (Ray has declared it dead)."""
        spare = self._take_spare_worker(worker_id)
        if spare is None and self.actor_placement.holds_worker(worker_id):
            self.actor_placement.await_declared_dead(self.group.slots[worker_id].actor)
        return spare

    def _take_spare_worker(self, worker_id: int) -> Any:
        while (spare := self.worker_spares.take()) is not None:
            actor, bundle = spare
            try:
                ray.get(actor.assume.remote(self._worker_config(worker_id)))
            except ACTOR_GONE:  # lost since it answered: the next spare, or a new actor
                self.worker_spares.free(actor, bundle)
                continue
            left = self.actor_placement.move_worker(worker_id, bundle)
            self.worker_spares.free(self.group.slots[worker_id].actor, left)
            log.info("a warm spare takes worker %d's place", worker_id)
            return actor
        return None

    @property
    def workers(self) -> list[Any]:
        """The live worker actors, by worker id."""
        return self.group.actors

    def _placement(self) -> list[list[tuple[int, int, int, bool]]]:
        return self.shard_group.placement()
