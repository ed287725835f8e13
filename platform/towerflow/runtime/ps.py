"""Parameter-server shard: a Ray actor that owns some variables, their optimizer slots and a version.

Workers talk to shards directly; what a reply carries is runtime/shard_publishing.py's.
Pushed gradients go to the update protocol (sync or async), which says whether to hold, apply or
drop them.

A shard's pieces may come in several gradient buckets, pushed one by one while the workers' backward
pass still runs. Each bucket has its own protocol and version, as each variable had its own gradient
accumulator under SyncReplicasOptimizer; the shard's version (the global step) moves on, and is
published, once every bucket has been applied.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import time
from typing import Any

import numpy as np
import ray

from towerflow.runtime.accumulator import GradientAccumulator
from towerflow.runtime.fencing import DriverTerm
from towerflow.runtime.protocol import AsyncProtocol, UpdateProtocol, Verdict
from towerflow.runtime.push_order import PushOrder
from towerflow.runtime.shard_checkpoints import ShardCheckpoints
from towerflow.runtime.shard_parts import LiveState, OwnCopy, PartSource, ShardSnapshot
from towerflow.runtime.shard_publishing import ShardPublishing
from towerflow.runtime.shard_replies import ParamsReply, PushReply
from towerflow.runtime.tf_setup import TFProcessConfig, configure_tensorflow

_STEP_WORKERS_KEPT = 256  # recent steps whose workers a woken sync push or the driver may still ask for


class ParameterShard(ShardCheckpoints, ShardPublishing, DriverTerm):
    """One shard. Run as an async Ray actor so that sync pushes can wait for their step cheaply.

    It starts in two steps: the actor itself (its process imports TensorFlow, seconds of CPU), which
    the driver creates at the same time as the workers, then `load` with its pieces, once the
    driver knows the model's variables from a worker. The job starts in the longer of the two
    start-ups instead of their sum.
    """

    def __init__(self, shard_id: int | None, cpus: float = 0.5, *, apply_threads: int | None = None) -> None:
        """`shard_id` None: a warm spare, whose place `load` gives it."""
        # Sync workers wait while shards apply, so a sync shard may use their cores for the apply.
        configure_tensorflow(shard_tf_config(cpus, apply_threads))
        import tensorflow as tf

        self.shard_id = shard_id
        self._tf = tf
        # Version -> the state this shard wrote to that checkpoint (stored, or kept for a memory
        # checkpoint), from the newest committed one on: a rollback to it reloads from here, not
        # from the store. Between checkpoints one more copy of the shard's state in memory (two
        # while the next is being taken).
        self._written: dict[int, ShardSnapshot] = {}
        # (shard id, version) -> another shard's state, held for it: its part of a memory checkpoint
        self._peer_copies: dict[tuple[int, int], ShardSnapshot] = {}
        self._order = PushOrder()  # a new one with each `load`
        self._loaded = False  # by a `load` of this run (a kept shard's last run's state is no load)

    def reset(self, shard_id: int) -> None:
        """A kept shard's next run (runtime/actor_pool.py), as shard `shard_id`: the last run's
        copies go; `load` gives it the rest."""
        self.shard_id = shard_id
        self._written, self._peer_copies = {}, {}
        self._loaded = False
        self._forget_term()

    def load(
        self,
        names: list[str],
        initial_values: list[np.ndarray] | PartSource | OwnCopy | ShardSnapshot | LiveState,
        optimizer: dict[str, Any],
        protocol: UpdateProtocol,
        max_steps: int | None,
        *,
        initial_slots: dict[str, list[np.ndarray]] | None = None,
        initial_version: int = 0,
        snapshot_every: int | None = None,
        buckets: list[int] | None = None,
        shard_id: int | None = None,
        examples_seen: int = 0,
        term: int = 0,
        loading: int = 0,
    ) -> bool:
        """Take this shard's pieces, their optimizer and update protocol; publish the first version.
        Called once, before any worker pulls or pushes. Pieces given as a checkpoint part are read
        here, from the store; False (nothing loaded) where this node cannot reach it. `shard_id`:
        the place this shard takes, where it is not the one it started in (a spare's);
        `examples_seen`: the run's data position at `initial_version` (`live_position`); `term`:
        the calling driver's (runtime/fencing.py); `loading`: the number of the load this is one
        of, the same for every shard of it (`live_position`)."""
        from towerflow.runtime.optimizers import build_optimizer

        self._obey(term, "loading a shard")

        if shard_id is not None:
            self.shard_id = shard_id
        initial_values, initial_slots = self._starting_state(
            names, initial_values, initial_slots, initial_version
        )
        if initial_values is None:
            return False

        tf, shard_id = self._tf, self.shard_id
        self._names = names
        self._optimizer = build_optimizer(optimizer)
        self._variables = [
            tf.Variable(np.asarray(v), name=f"shard{shard_id}_{i}") for i, v in enumerate(initial_values)
        ]
        self._slots = [
            {
                slot: tf.Variable(
                    np.asarray(initial_slots[slot][i])
                    if initial_slots
                    else self._optimizer.slot_initial_value(slot, np.asarray(value))
                )
                for slot in self._optimizer.slot_names
            }
            for i, value in enumerate(initial_values)
        ]
        piece_buckets = list(buckets) if buckets is not None else [0] * len(initial_values)
        # bucket id -> positions of its pieces here, in push order (the order workers send them in)
        self._buckets = {
            b: [i for i, pb in enumerate(piece_buckets) if pb == b] for b in sorted(set(piece_buckets))
        }
        self._last_bucket = max(self._buckets)  # a worker's last push of a step: counted once
        self._protocols = {b: copy.deepcopy(protocol) for b in self._buckets}
        self._accumulators = {b: GradientAccumulator() for b in self._buckets}
        self._bucket_versions = dict.fromkeys(self._buckets, initial_version)
        self._max_steps = max_steps
        self._version = initial_version
        self._done = max_steps is not None and initial_version >= max_steps
        self._changed: asyncio.Condition | None = None
        self._order.close()
        self._order = PushOrder()
        # applied: updates (versions); gradients: the gradients they averaged
        self._counts = {
            "applied": 0,
            "gradients": 0,
            "stale": 0,
            "rejected": 0,
            "retired": 0,  # pushes of a worker retired or replaced: a lost one's, late
            "skipped": 0,
            "after_done": 0,
        }
        self._apply_total_s = 0.0
        self._last_apply_s = 0.0
        self._version_apply_s = 0.0  # apply time of the buckets of the version being built
        self._reset_publishing()
        self._reset_snapshots(snapshot_every)
        self._taken: collections.Counter[int] = collections.Counter()  # worker id -> examples taken
        self._examples_before = examples_seen  # the data position when `_taken` began
        self._loading = loading
        self._step_workers: dict[int, tuple[int, ...]] = {}  # the last bucket's versions
        self._loaded = True
        return True

    # -- the protocol's verbs ------------------------------------------------------------------
    async def pull(self, min_version: int = 0) -> ParamsReply:
        await self._wait_for(lambda: self._version >= min_version or self._done)
        return self._params_reply()

    async def push(
        self,
        gradients: list[np.ndarray] | None,
        version_read: int,
        worker: int,
        bucket: int = 0,
        examples: int = 0,
        with_params: bool = True,
        incarnation: int = 0,
        number: int | None = None,
    ) -> PushReply:
        """Gradients for this shard's pieces of `bucket`, computed against `version_read` on a batch
        of `examples` examples (counted per worker: the rows a lost worker used) by `worker`'s run
        `incarnation` (its `join`). The reply carries the parameters to compute the next step with,
        unless the worker goes on with its own (`with_params` False: async fetch_every), and then
        publishes nothing. `number`: the push's place in the worker's run, where it may have
        several in flight (overlap_push): they are taken in that order (runtime/push_order.py).

        None is a skipped gradient (its loss was not finite, nan_guard: skip): sync counts the
        worker in its step all the same, with nothing added, so the others do not wait for it.
        """
        order = self._order
        async with order.turn((worker, incarnation, bucket), number):
            if order.closed:  # an earlier run's push, held for its turn while the shard was loaded again
                return PushReply(Verdict.DONE, -1, 0, 0.0, ParamsReply(self._version, None, True))
            counted = bucket == self._last_bucket  # one count per gradient, however many buckets it came in
            if self._done or self._bucket_exhausted(bucket):
                self._counts["after_done"] += counted
                # The last version's other buckets may still be applying: the reply names the
                # run done, not version max_steps - 1 to compute a step more on.
                await self._wait_for(lambda: self._version > version_read or self._done)
                return PushReply(Verdict.DONE, -1, 0, 0.0, self._params_reply())
            protocol, accumulator = self._protocols[bucket], self._accumulators[bucket]
            decision = protocol.on_push(version_read, self._bucket_versions[bucket], worker, incarnation)
            if decision.verdict is Verdict.RETIRED:
                # Its rows went to its replacement, uncounted here: no steps are left for this incarnation.
                self._counts["retired"] += counted
                return PushReply(Verdict.RETIRED, -1, 0, 0.0, ParamsReply(self._version, None, True))
            self._taken[worker] += examples if counted else 0
            if gradients is None and isinstance(protocol, AsyncProtocol):
                self._counts["skipped"] += counted
                return PushReply(
                    Verdict.SKIPPED, -1, 0, 0.0, self._next_params(protocol.lockstep, with_params)
                )
            verdict, step = decision.verdict, -1
            if (
                decision.verdict is Verdict.APPLY
                and gradients is not None
                and decision.count == 1
                and not accumulator.count
            ):
                step = self._apply(bucket, list(gradients), (worker,))  # async, or one
                verdict = Verdict.APPLIED
            elif decision.verdict is Verdict.APPLY:
                if gradients is not None:
                    accumulator.add(gradients, worker)
                step, verdict = self._apply_held(bucket), Verdict.APPLIED
            elif decision.verdict is Verdict.HELD:
                if gradients is not None:
                    accumulator.add(gradients, worker)
                await self._wait_for(lambda: self._bucket_versions[bucket] > version_read or self._done)
                applied = self._bucket_versions[bucket] > version_read
                step, verdict = (version_read + 1, Verdict.APPLIED) if applied else (-1, Verdict.DONE)
            else:
                self._counts[decision.verdict] += counted
            if gradients is None and verdict is Verdict.APPLIED:
                verdict, self._counts["skipped"] = Verdict.SKIPPED, self._counts["skipped"] + counted
            next_version = protocol.next_version_to_read(version_read)
            await self._wait_for(lambda: self._version >= next_version or self._done)
            # First: a publication here counts in the apply time.
            params = self._next_params(protocol.lockstep, with_params)
            return PushReply(
                verdict,
                step,
                decision.staleness,
                self._last_apply_s,
                params,
                workers=self._step_workers.get(step, ()) if bucket == self._last_bucket else (),
            )

    async def retire(self, worker: int, incarnation: int | None = None) -> None:
        """A worker stopped pushing (done, failed or lost); sync aggregation goes on with the others.
        `incarnation`: the worker's own, at its run's end (None: the driver's, of a lost worker)."""
        for bucket, protocol in self._protocols.items():
            decision = protocol.on_retire(worker, incarnation)
            if decision.verdict is Verdict.APPLY and not self._done:
                self._apply_held(bucket)

    def join(self, worker: int, incarnation: int) -> None:
        """A worker's run takes part in the steps from now on, as `incarnation` (a number of the
        run's own; a replacement's, under its lost one's id, takes the place of the lost one's)."""
        for protocol in self._protocols.values():
            protocol.on_join(worker, incarnation)
        self._order.forget(worker)

    def resize(
        self, total_num_replicas: int, replicas_to_aggregate: int, examples_seen: int, term: int = 0
    ) -> None:
        """An elastic resize: the workers were stopped between steps and start again, this many, on
        data planned from `examples_seen`."""
        self._obey(term, "resizing a shard")
        for protocol in self._protocols.values():
            protocol.resize(total_num_replicas, replicas_to_aggregate)
        self._taken.clear()  # the workers start on freshly planned data
        self._examples_before = examples_seen

    def examples_taken(self) -> dict[int, int]:
        """Worker id -> the examples of the gradients this shard took from it, applied or dropped,
        since it was loaded or resized: the rows a lost worker used, counted where they arrived."""
        return dict(self._taken)

    def live_position(self) -> tuple[int, int, int] | None:
        """This shard's version, the run's data position as the gradients it took tell, and the
        number of the load it was last given: what a driver taking the shards over goes on from,
        if they were all loaded together (runtime/run_keeper.py). Examples of gradients taken
        but not yet applied count: their rows were read. None before this run's first load (its
        driver was lost as the run started): nothing to go on from."""
        if not self._loaded:
            return None
        return self._version, self._examples_before + sum(self._taken.values()), self._loading

    async def finish(self, term: int = 0) -> int:
        """Stop accepting gradients and release every waiting worker."""
        self._obey(term, "finishing a shard")
        self._take_no_more()
        await self._notify()
        return self._version

    def settle_at(self, version: int, term: int = 0) -> int:
        """After an async run's end (finished, no update follows): take `version`, the furthest
        shard's, as this shard's last. Bounded staleness judges each push at each shard on its
        own, and a late gradient one shard applied another may have dropped, so their counts of
        updates drift apart by those drops; the state each ended with is the run's last all the
        same, as a take-over's shards go on from the furthest (runtime/run_keeper.py)."""
        self._obey(term, "settling a shard's last version")
        if not self._done:
            raise RuntimeError(f"shard {self.shard_id} is still training: only a finished shard settles")
        if version > self._version:
            self._version = version
            self._bucket_versions = dict.fromkeys(self._bucket_versions, version)
        return self._version

    # -- inspection ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        var_bytes = sum(_nbytes(v) for v in self._variables)
        slot_bytes = sum(_nbytes(v) for slots in self._slots for v in slots.values())
        return {
            "shard": self.shard_id,
            "version": self._version,
            "bucket_versions": dict(self._bucket_versions),
            **self._counts,
            "apply_s_total": self._apply_total_s,
            "publications": self._publications,  # versions sent: put in the object store or in a reply
            "variable_bytes": int(var_bytes),
            "slot_bytes": int(slot_bytes),
            "variables": list(self._names),
            "loaded_from": self._loaded_from,  # a checkpoint part this shard read itself, or the driver's values
        }

    def ping(self) -> int:
        return self._version

    def step_workers(self, after: int) -> dict[int, tuple[int, ...]]:
        """The recent steps after `after` and the workers whose gradients each applied: where a
        lost worker's gradient went in, its record will not come (the driver stops waiting for it)."""
        return {step: workers for step, workers in self._step_workers.items() if step > after}

    def pid(self) -> int:
        """This shard's process (fault benchmarks and tests kill it for real)."""
        import os

        return os.getpid()

    # -- internals -------------------------------------------------------------------------------
    def _take_no_more(self) -> None:
        """Done: no gradient is taken from now on, and no numbered push waits for its turn."""
        self._done = True
        self._order.let_go()

    def _bucket_exhausted(self, bucket: int) -> bool:
        return self._max_steps is not None and self._bucket_versions[bucket] >= self._max_steps

    def _apply_held(self, bucket: int) -> int:
        """Apply the mean of the gradients the bucket's accumulator holds; with none (every worker
        of the step skipped its gradient), the version moves on with no update."""
        accumulator = self._accumulators[bucket]
        if accumulator.count:
            return self._apply(bucket, *accumulator.take())
        return self._apply(bucket, None, ())

    def _apply(self, bucket: int, gradients: list[Any] | None, workers: tuple[int, ...]) -> int:
        """Apply `gradients` (the sum of `workers`' gradients: from two on the accumulator's
        buffers, averaged here in place) to the bucket's pieces; returns the bucket's new version.
        None: no update, the version moves on."""
        count = len(workers)
        start = time.perf_counter()
        tf = self._tf
        version = self._bucket_versions[bucket]
        if gradients is not None:
            if count > 1:  # the accumulator's own sums (count 1 is a pushed gradient, read-only)
                for total in gradients:
                    np.multiply(total, np.float32(1.0 / count), out=total)
            # Eagerly (CPU per Adam update, tf.function against eager: 0.44 against 0.12 ms for
            # 7,850 parameters, 0.81 against 0.40 for 397,510, 4.7 against 3.8 for 3.3 million).
            at = self._buckets[bucket]
            self._optimizer.apply_all(
                tf,
                [self._variables[i] for i in at],
                [self._slots[i] for i in at],
                gradients,
                tf.constant(self._optimizer.learning_rate(version), tf.float32),
                tf.constant(version + 1, tf.float32),
            )
        self._bucket_versions[bucket] = version + 1
        if bucket == self._last_bucket:  # the step a worker's record names (see PushReply.workers)
            self._step_workers[version + 1] = workers
            self._step_workers.pop(version + 1 - _STEP_WORKERS_KEPT, None)
        self._version_apply_s += time.perf_counter() - start
        if min(self._bucket_versions.values()) > self._version:
            self._complete_version(count)
        asyncio.get_running_loop().create_task(self._notify())
        return version + 1

    def _complete_version(self, replicas: int) -> None:
        """Every bucket has been applied: the next version exists (snapshot it if asked; the first
        reply that needs it publishes it)."""
        start = time.perf_counter()
        self._version += 1
        self._counts["applied"] += 1
        self._counts["gradients"] += replicas
        if self._max_steps is not None and self._version >= self._max_steps:
            self._take_no_more()
        self._snapshot_if_due()
        self._last_apply_s = self._version_apply_s + time.perf_counter() - start
        self._version_apply_s = 0.0
        self._apply_total_s += self._last_apply_s

    async def _wait_for(self, predicate) -> None:
        if predicate():
            return
        changed = self._condition()
        async with changed:
            await changed.wait_for(predicate)

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed


def _nbytes(variable) -> int:
    """Size from shape and dtype: no copy of the value (tf and Keras variables alike)."""
    return (
        int(np.prod(variable.shape))
        * np.dtype(getattr(variable.dtype, "as_numpy_dtype", variable.dtype)).itemsize
    )


def shard_tf_config(cpus: float, apply_threads: int | None) -> TFProcessConfig:
    """A shard's TensorFlow set-up: threads from its CPUs, or from the workers' it borrows to apply."""
    return TFProcessConfig(cpus=max(cpus, apply_threads or 0), keras=False)


def shard_actor(cpus: float):
    """The Ray actor class for a shard with this CPU reservation."""
    return ray.remote(num_cpus=cpus, max_restarts=0, max_concurrency=1000)(ParameterShard)
