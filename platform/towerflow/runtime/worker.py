"""Tower worker: a Ray actor that streams its data split, computes gradients on its towers and
talks to the parameter-server shards directly (pull parameters, push gradients).

The driver only starts `run` and drains the per-step records; no tensor passes through it. The
actor builds the model and answers the driver; the steps themselves are step_loop.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray

from towerflow.errors import SpecError
from towerflow.runtime.batches import BatchAdapter, TowerModel, leftover_batches
from towerflow.runtime.fencing import DriverTerm
from towerflow.runtime.held_copies import HeldCopies
from towerflow.runtime.model_state import load_model_state, model_state_of
from towerflow.runtime.pushes import Placement, PushPlan
from towerflow.runtime.shard_replies import parameter_values
from towerflow.runtime.shared_buffers import assign_pulled
from towerflow.runtime.step_loop import StepLoop
from towerflow.runtime.step_profiler import StepWindowProfiler
from towerflow.runtime.tf_setup import configure_tensorflow, gpu_peak_mb
from towerflow.runtime.worker_config import WorkerConfig
from towerflow.runtime.worker_messages import Rejoin, StepRecord, WarmUp, WorkerReport
from towerflow.shared_types import VariableInfo, as_stream, until_stopped

log = logging.getLogger(__name__)
# How long a spare waits for its node's reader (TensorFlow's import took up to ~20 s on a loaded
# 2-core test node) before it joins without it; the first read task there then starts a process.
READER_READY_TIMEOUT_S = 120.0


class TowerWorker(HeldCopies, DriverTerm):
    def __init__(self, config: WorkerConfig) -> None:
        self._build(config)

    def rebuild(self, config: WorkerConfig) -> bool:
        """A kept worker's next run (runtime/actor_pool.py): everything built anew under `config`
        (model, towers, step loop), as a new actor would, in this process whose TensorFlow is
        imported and set up already. False, and nothing done, where `config` sets TensorFlow up
        otherwise (threads and devices are fixed once it has run)."""
        if config.tf.settings() != self.config.tf.settings():
            return False
        import keras

        keras.backend.clear_session()  # layer names as a new process's: checkpoints key on them
        self._build(config)
        self._forget_term()
        return True

    def _build(self, config: WorkerConfig) -> None:
        # First, so that the node's reader starts alongside this worker (both import TensorFlow).
        ready = config.ready_node_for_reading
        self._reading_ready = ready(ray.get_runtime_context().get_node_id()) if ready else None
        self._node_readied = False  # its node has a process ready for reading (a spare's)
        devices = configure_tensorflow(config.tf)
        import keras

        from towerflow.imports import import_ref

        # Seeded per worker: dropout and other random layers draw different masks on each replica,
        # as on TensorFlow's devices. Initial weights differ too, but only worker 0's reach the shards.
        keras.utils.set_random_seed(config.seed + max(config.worker_id, 0))
        build = import_ref(config.model_ref)
        self.model = build(**config.model_params)
        if not self.model.trainable_variables:
            raise SpecError(
                f"model.ref: {config.model_ref} built a model with no trainable variables yet; start it with keras.Input(...) "
                "so its variables exist before training"
            )
        from towerflow.runtime.towers import TowerStep

        self.config = config
        self.devices = devices
        self.loss_config = {"class_name": _LOSS_CLASSES[config.loss], "config": _loss_config(config)}
        loss_fn = keras.losses.get(self.loss_config)
        self.towers = TowerStep(
            self.model,
            loss_fn,
            devices,
            metrics=config.metrics,
            clip_global_norm=config.clip_global_norm,
            from_logits=config.from_logits,
        )
        input_names = [getattr(t, "name", f"input_{i}") for i, t in enumerate(self.model.inputs)]
        self.adapter = BatchAdapter(input_names, config.label, config.feature_scales)
        self._profiler = StepWindowProfiler(config.profile_steps)
        self._loop = StepLoop(config, self.model, self.towers, self.adapter, self._profiler)
        self._running = threading.Lock()  # held while a run is under way (`rest` waits for it)
        # the copy of a lone shard's state it holds for a memory checkpoint (with no spare shard)
        self._peer_copies = {}

    # -- called by the driver --------------------------------------------------------------------
    def assume(self, config: WorkerConfig) -> bool:
        """Take a worker's place under `config` (a warm spare a lost worker's; a lost driver's worker
        its own under the new driver): its id, seed, start step, faults and profile. The model, the
        towers, its step loop and what they traced stay: the actor's own start. False, and nothing
        taken, where `config` would build another model or towers (`WorkerConfig.built_alike`)."""
        if not config.built_alike(self.config):
            return False
        import keras

        keras.utils.set_random_seed(config.seed + max(config.worker_id, 0))
        self.config = config
        self._profiler = StepWindowProfiler(config.profile_steps)
        self._loop.assume(config, self._profiler)
        return True

    def describe(self) -> tuple[list[VariableInfo], list[np.ndarray]]:
        """The trainable variables (in model order) and their initial values."""
        infos, values = [], []
        for i, var in enumerate(self.model.trainable_variables):
            value = np.asarray(var.numpy())
            infos.append(VariableInfo(i, var.path, tuple(value.shape), str(value.dtype), int(value.nbytes)))
            values.append(value)
        return infos, values

    def model_state(self) -> dict[str, np.ndarray]:
        """The model's non-trainable variables (batch-norm moving statistics and the like), by path.

        They are not on the shards: each worker updates its own copy as it trains, as each replica
        does under TensorFlow's MirroredStrategy.
        """
        return model_state_of(self.model)

    def load_model_state(self, state: dict[str, np.ndarray]) -> int:
        """Assign `state` to the non-trainable variables, in model order; returns how many."""
        return load_model_state(self.model, state)

    def devices_used(self) -> list[str]:
        return list(self.devices)

    def warm_up_info(self) -> WarmUp | None:
        """What a spare needs to trace this worker's step ahead (None before its first batch)."""
        return self._loop.warm_up

    def warm_up(self, placement: Placement, buckets: list[list[int]], info: WarmUp) -> int:
        """Trace the step a run with these pushes takes, for batches like a member's (`info`),
        without running it: a spare does it before it joins, so that its first step does not hold
        every worker of a sync step while it traces. It returns once its node is ready for reading
        too (`WorkerConfig.ready_node_for_reading`). Returns the traces made so far."""
        self._loop.attach(PushPlan([], placement, buckets))
        self._wrap_towers(info.tower_preprocess)
        self.towers.trace(info.signature)
        if self._reading_ready is not None:
            try:
                ray.get(self._reading_ready, timeout=READER_READY_TIMEOUT_S)
                self._node_readied = True
            except ray.exceptions.RayError as exc:  # the first read there starts a process instead
                log.info("worker %d: its node could not ready a reader: %s", self.config.worker_id, exc)
            self._reading_ready = None
        return self.towers.traces

    def _wrap_towers(self, tower_preprocess: list[str]) -> None:
        if tower_preprocess and not isinstance(self.towers.model, TowerModel):
            self.towers.model = TowerModel(self.model, tower_preprocess)

    def pid(self) -> int:
        """This worker's process (fault benchmarks and tests kill or pause it for real)."""
        import os

        return os.getpid()

    def drain(self) -> WorkerReport:
        return dataclasses.replace(self._loop.drain(), term=self._term)

    def request_stop(self, run_number: int) -> None:
        self._loop.request_stop(run_number)

    def rest(self, timeout_s: float) -> tuple[int, list[StepRecord]] | None:
        """Come to rest for a new driver (runtime/run_keeper.py): the run under way, whose driver
        was lost, stops after its step; wait up to `timeout_s` for it to end. Returns the number of
        the last run (the next must be higher) and the records of the last steps (those the lost
        driver may not have logged, and those taken without it), or None where it is still running."""
        self._loop.request_stop(self._loop.run_number)
        if not self._running.acquire(timeout=timeout_s):
            return None
        try:
            return self._loop.run_number, self._loop.recent_records()
        finally:
            self._running.release()

    def evaluate(
        self,
        shards: list[Any],
        placement: list[list[tuple[int, int, int, bool]]],
        source: Any,
        metric_names: list[str],
        batch_size: int,
        max_batches: int | None = None,
        model_state: dict[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, float]]:
        """Evaluate the shards' current parameters on the evaluation files, read in order.

        Run on an evaluator actor of its own (TensorFlow's evaluator task), or on a worker whose
        training is over, never on one still training: it assigns the model's variables and state.
        Returns (version evaluated, metrics).
        """
        from towerflow.runtime.evaluation import evaluate_model

        replies = ray.get([shard.pull.remote(0) for shard in shards])
        assign_pulled(self.model.trainable_variables, parameter_values(replies), placement)
        if model_state:
            load_model_state(self.model, model_state)
        self.adapter.varlen = source.varlen
        metrics = evaluate_model(
            self.model,
            self.adapter,
            source,
            self.config,
            self.loss_config,
            metric_names,
            batch_size,
            max_batches,
        )
        return replies[0].version, metrics

    def profile(self) -> dict[str, Any] | None:
        """The TensorFlow profiler trace of the profiled steps: files (relative path -> bytes) and window."""
        return self._profiler.collect()

    def run(
        self,
        shards: list[Any],
        placement: Placement,
        buckets: list[list[int]],
        data: Any,
        rejoin: Rejoin | None = None,
        *,
        run_number: int = 1,
        term: int = 0,
    ) -> dict[str, Any]:
        """Train until the data ends, the shards say the last step is done, or the driver stops us.

        `placement[s]` lists shard s's pieces as (variable index, start row, stop row, whole?), and
        `buckets[s]` the gradient bucket of each: buckets are pushed from inside the backward pass.
        A replacement worker gets `rejoin`: the rows its lost predecessor had received and not
        trained on (data/splits.py), read before its split, and the model's non-trainable state.
        Refused to a driver of an earlier `term` than this worker's (runtime/fencing.py): checked
        before and after the wait for the run under way (a newer driver's may have fenced it since).
        """
        self._obey(term, "starting a worker's run")
        with self._running:
            self._obey(term, "starting a worker's run")
            loop = self._loop
            stop = loop.new_run(run_number)
            loop.attach(PushPlan(shards, placement, buckets))
            start = time.perf_counter()
            stream = as_stream(data)
            self.adapter.varlen = stream.options.varlen
            self._wrap_towers(stream.options.tower_preprocess)
            traces = self.towers.traces
            steps, examples = loop.run(self._batches(stream, rejoin, stop), stream.options.tower_preprocess)
        return {
            "worker": self.config.worker_id,
            "steps": steps,
            "examples": examples,
            "seconds": time.perf_counter() - start,
            "devices": list(self.devices),
            "gpu_peak_mb": gpu_peak_mb(self.devices),
            "traces": self.towers.traces - traces,  # 0: its step was traced before (a warmed spare's)
            "node_readied_for_reading": self._node_readied,
        }

    def _batches(self, stream: Any, rejoin: Rejoin | None, stop: threading.Event) -> Iterator[Any]:
        """This worker's batches: a lost predecessor's leftover rows first (`rejoin`), then its split."""
        cfg = self.config
        batches = iter(
            stream.batches(
                batch_size=cfg.batch_size,
                drop_last=cfg.drop_remainder,
                shuffle_buffer=cfg.shuffle_buffer,
                seed=cfg.seed + cfg.worker_id,
                stop=stop,
            )
        )
        if cfg.start_at_step:
            # Join the data stream first: Ray Data starts an epoch only once every split has asked
            # for it, so a worker that waited before asking would hold up the others.
            batches = itertools.chain([next(batches, None)], batches)
        if rejoin is not None:
            if rejoin.model_state:
                load_model_state(self.model, rejoin.model_state)
            if rejoin.leftover:
                leftover = until_stopped(leftover_batches(rejoin.leftover, cfg.batch_size), stop)
                batches = itertools.chain(leftover, batches)
        return batches


_LOSS_CLASSES = {
    "sparse_categorical_crossentropy": "SparseCategoricalCrossentropy",
    "categorical_crossentropy": "CategoricalCrossentropy",
    "binary_crossentropy": "BinaryCrossentropy",
    "mse": "MeanSquaredError",
    "mae": "MeanAbsoluteError",
}


def _loss_config(config: WorkerConfig) -> dict[str, Any]:
    return {"from_logits": config.from_logits} if config.loss.endswith("crossentropy") else {}


def worker_actor(cpus: float, gpus: float):
    """The Ray actor class for a worker with this reservation (threads: run, drain/stop, rest or a
    memory checkpoint's copy)."""
    return ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=0, max_concurrency=3)(TowerWorker)
