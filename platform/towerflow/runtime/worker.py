"""Tower worker: a Ray actor that streams its data split, computes gradients on its towers and
talks to the parameter-server shards directly (pull parameters, push gradients).

The driver only starts `run` and drains the per-step records; no tensor passes through it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from towerflow.errors import SpecError
from towerflow.runtime.batches import BatchAdapter, TowerModel, leftover_batches
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.model_state import load_model_state, model_state_of
from towerflow.runtime.ps import parameter_values
from towerflow.runtime.pushes import Placement, PushPlan, StepPushes
from towerflow.runtime.shared_buffers import assign_immutable, assign_rows
from towerflow.runtime.step_profiler import StepWindowProfiler
from towerflow.runtime.tf_setup import configure_tensorflow, gpu_peak_mb
from towerflow.runtime.towers import signature_of
from towerflow.runtime.user_errors import misfit_error
from towerflow.runtime.worker_config import WorkerConfig
from towerflow.runtime.worker_messages import Rejoin, StepRecord, WarmUp, WorkerReport
from towerflow.shared_types import VariableInfo, as_stream, until_stopped

log = logging.getLogger(__name__)
# How long a spare waits for its node's reader (TensorFlow's import took up to ~20 s on a loaded
# 2-core test node) before it joins without it; the first read task there then starts a process.
READER_READY_TIMEOUT_S = 120.0


class TowerWorker:
    def __init__(self, config: WorkerConfig) -> None:
        # First, so that the node's reader starts alongside this worker (both import TensorFlow).
        ready = config.ready_node_for_reading
        self._reading_ready = ready(ray.get_runtime_context().get_node_id()) if ready else None
        self._node_readied = False  # its node has a process ready for reading (a spare's)
        devices = configure_tensorflow(config.tf)
        import keras
        import tensorflow as tf

        self._misfit_errors = (ValueError, TypeError, tf.errors.InvalidArgumentError)

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
        self._variables = self.model.trainable_variables  # fixed once built; read every step
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
        self._records: collections.deque[StepRecord] = collections.deque()
        self._stop = threading.Event()
        self._profiler = StepWindowProfiler(config.profile_steps)
        self._plan: PushPlan | None = None
        self._bucket_variables: list[list[int]] = []
        self._step: StepPushes | None = None  # the step in progress, as the push hooks see it
        self._busy_since: float | None = None  # when the current step's own work began (monotonic)
        self._faults = config.faults or FaultInjector()
        self._warm_up: WarmUp | None = None  # what a spare needs to trace ahead, from the first batch

    # -- called by the driver --------------------------------------------------------------------
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
        return self._warm_up

    def warm_up(self, placement: Placement, buckets: list[list[int]], info: WarmUp) -> int:
        """Trace the step a run with these pushes takes, for batches like a member's (`info`),
        without running it: a spare does it before it joins, so that its first step does not hold
        every worker of a sync step while it traces. It returns once its node is ready for reading
        too (`WorkerConfig.ready_node_for_reading`). Returns the traces made so far."""
        self.towers.push_in_buckets(PushPlan([], placement, buckets).bucket_variables, self._push_bucket)
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
        records = []
        while self._records:
            records.append(self._records.popleft())
        since = self._busy_since
        return WorkerReport(records, None if since is None else time.monotonic() - since)

    def request_stop(self) -> None:
        self._stop.set()

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
        self._assign(parameter_values(replies), placement)
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

    def _assign(self, per_shard: list[list[np.ndarray]], placement) -> None:
        """Load pulled parameters into the model: a whole variable takes the pulled (immutable)
        array's buffer without a copy, a variable cut across shards its rows joined in one copy."""
        variables = self._variables
        cut: dict[int, list[tuple[int, np.ndarray]]] = {}
        for shard_values, pieces in zip(per_shard, placement):
            for value, (index, start, _stop, whole) in zip(shard_values, pieces):
                if whole:
                    assign_immutable(variables[index], value)
                else:
                    cut.setdefault(index, []).append((start, value))
        for index, rows in cut.items():
            assign_rows(variables[index], [value for _, value in sorted(rows, key=lambda row: row[0])])

    def _injected_loss(self, step: StepPushes, loss: float) -> float:
        """The loss, or NaN where a test's fault injector says so."""
        return self._faults.loss(self.config.worker_id, step.global_step, loss)

    def _push_bucket(self, bucket: int, loss: np.ndarray, *gradients: np.ndarray) -> np.int64:
        """Push hook, called by the tower graph (on one of TensorFlow's threads) for each bucket.

        It never pushes a gradient whose loss is not finite (the NaN guard), and it never raises
        into TensorFlow: an error is kept for the worker to raise once the step returns.
        """
        step, cfg = self._step, self.config
        if step is None or step.nonfinite or step.error is not None:
            return np.int64(0)
        try:
            if cfg.nan_guard and not np.isfinite(self._injected_loss(step, float(loss))):
                step.nonfinite = True
                if cfg.skip_nonfinite:  # the shards count this worker in the step, with no gradient
                    for bucket_id in range(len(self._bucket_variables)):
                        sent = self._plan.send(
                            bucket_id, None, step.versions, cfg.worker_id, step.examples, step.fetch
                        )
                        for shard, ref in sent:
                            step.sent.append((shard, bucket_id, ref))
                return np.int64(0)
            if bucket == 0 and self._faults.delay(cfg.worker_id):
                time.sleep(self._faults.delay(cfg.worker_id))
            by_variable = dict(zip(self._bucket_variables[bucket], gradients, strict=True))
            for shard, ref in self._plan.send(
                bucket, by_variable, step.versions, cfg.worker_id, step.examples, step.fetch
            ):
                step.sent.append((shard, bucket, ref))
        except BaseException as exc:  # noqa: BLE001 - handed to the worker's own thread
            step.error = exc
        return np.int64(0)

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
    ) -> dict[str, Any]:
        """Train until the data ends, the shards say the last step is done, or the driver stops us.

        `placement[s]` lists shard s's pieces as (variable index, start row, stop row, whole?), and
        `buckets[s]` the gradient bucket of each: buckets are pushed from inside the backward pass.
        A replacement worker gets `rejoin`: the rows its lost predecessor had received and not
        trained on (data/splits.py), read before its split, and the model's non-trainable state.
        """
        cfg = self.config
        self._stop = threading.Event()  # a run after a rollback starts anew; the last one's readers end
        self._plan = PushPlan(shards, placement, buckets)
        self._bucket_variables = self._plan.bucket_variables
        self.towers.push_in_buckets(self._bucket_variables, self._push_bucket)
        start = time.perf_counter()
        stream = as_stream(data)
        self.adapter.varlen = stream.options.varlen
        self._wrap_towers(stream.options.tower_preprocess)
        traces = self.towers.traces
        batches = self._batches(stream, rejoin)
        # A replacement takes its predecessor's place in every step still to aggregate.
        ray.get([shard.join.remote(cfg.worker_id) for shard in shards])
        replies = ray.get([shard.pull.remote(cfg.start_at_step) for shard in shards])
        versions = [r.version for r in replies]
        fresh = replies  # parameters not yet loaded into the model (None: the model holds the last)
        done = any(r.done for r in replies)
        steps = computed = examples = 0
        inflight: _Computed | None = None  # overlap_push: the step whose push is still on its way
        try:
            while not done and not self._stop.is_set():
                self._profiler.at_step(versions[0] + 1)
                if computed:  # start-up (first batch, graph tracing) is not counted against the timeout
                    self._busy_since = time.monotonic()
                t0 = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break
                inputs, labels = self.adapter(batch)
                rows = int(labels.shape[0])
                if self._warm_up is None and rows == cfg.batch_size:  # a whole batch, as most are
                    self._warm_up = WarmUp(
                        signature_of(inputs, labels), list(stream.options.tower_preprocess)
                    )
                t1 = time.perf_counter()
                if fresh is not None:
                    self._assign(parameter_values(fresh), placement)
                    fresh = None
                t2 = time.perf_counter()
                # Downpour's n_fetch: new parameters with every fetch_every-th step's replies; the
                # steps in between compute on these (the shards count their staleness).
                step = StepPushes(versions, rows, fetch=(computed + 1) % cfg.fetch_every == 0)
                loss, metrics = self._compute(step, inputs, labels, first=not computed)
                computed += 1
                t3 = time.perf_counter()
                self._busy_since = None  # waiting for the shards is not this worker's hang
                if step.nonfinite and not cfg.skip_nonfinite:
                    # Keep the shards clean: report the step and stop this worker without pushing.
                    self._records.append(StepRecord.nonfinite(cfg.worker_id, versions[0], loss, rows))
                    break
                settling = _Computed(
                    step, loss, metrics, {"data": t1 - t0, "pull": t2 - t1, "compute": t3 - t2}
                )
                if cfg.overlap_push:
                    # Downpour's asynchronous push: the next step computes while this push travels,
                    # on the parameters of the reply to the push before it.
                    settling, inflight = inflight, settling
                    if settling is None:
                        continue
                replies = self._settle(settling)
                steps, examples = steps + 1, examples + settling.trained_examples
                if settling.step.fetch:
                    versions = [r.next.version for r in replies]
                    fresh = [r.next for r in replies]
                done = any(r.next.done for r in replies)
            if inflight is not None:  # the last push's reply, and its record
                self._settle(inflight)
                steps, examples = steps + 1, examples + inflight.trained_examples
        finally:
            self._busy_since = None
            self._profiler.stop()
            # Let sync aggregation go on without us (also when we failed); a lost shard is the
            # controller's to handle, not a reason to hide this worker's own error.
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get([shard.retire.remote(cfg.worker_id) for shard in shards])
        return {
            "worker": cfg.worker_id,
            "steps": steps,
            "examples": examples,
            "seconds": time.perf_counter() - start,
            "devices": list(self.devices),
            "gpu_peak_mb": gpu_peak_mb(self.devices),
            "traces": self.towers.traces - traces,  # 0: its step was traced before (a warmed spare's)
            "node_readied_for_reading": self._node_readied,
        }

    def _batches(self, stream: Any, rejoin: Rejoin | None) -> Iterator[Any]:
        """This worker's batches: a lost predecessor's leftover rows first (`rejoin`), then its split."""
        cfg = self.config
        batches = iter(
            stream.batches(
                batch_size=cfg.batch_size,
                drop_last=cfg.drop_remainder,
                shuffle_buffer=cfg.shuffle_buffer,
                seed=cfg.seed + cfg.worker_id,
                stop=self._stop,
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
                leftover = until_stopped(leftover_batches(rejoin.leftover, cfg.batch_size), self._stop)
                batches = itertools.chain(leftover, batches)
        return batches

    def _compute(
        self, step: StepPushes, inputs: Any, labels: Any, first: bool
    ) -> tuple[float, dict[str, Any]]:
        """Run the towers on a batch; the push hooks send each bucket as backprop produces it.

        Returns the loss (or NaN where a test's fault injector says so) and the metrics. A batch
        that does not fit the model at the first step is the spec's mismatch, named as such.
        """
        self._step = step
        try:
            loss, metrics, _ = self.towers(inputs, labels)
        except self._misfit_errors as exc:
            if not first:  # the spec fitted the data at the first step: not a mismatch
                raise
            raise misfit_error(
                exc, self.model, self.config, self.adapter.input_names, inputs, labels
            ) from exc
        finally:
            self._step = None
        if step.error is not None:
            raise step.error
        return self._injected_loss(step, float(loss)), metrics

    def _settle(self, computed: _Computed) -> list[Any]:
        """Wait for the replies to a computed step's pushes and record what became of it; returns,
        per shard, the reply that completed the step (it carries the next version)."""
        step, worker = computed.step, self.config.worker_id
        began = time.perf_counter()
        every = ray.get([ref for _, _, ref in step.sent])
        waited = time.perf_counter() - began
        replies = self._completing_replies(step, every)
        if step.nonfinite:  # skipped: counted in its step, no gradient
            self._records.append(StepRecord.nonfinite(worker, step.versions[0], computed.loss, step.examples))
        else:
            split = {**computed.split, "push": waited}
            self._records.append(
                StepRecord.of_step(worker, step, computed.loss, computed.metrics, every, replies, split)
            )
        return replies

    def _completing_replies(self, step: StepPushes, every: list[Any]) -> list[Any]:
        """Per shard, the reply to its last bucket's push: it completes the step and carries the
        next version."""
        last = {
            shard: reply
            for (shard, bucket, _), reply in zip(step.sent, every)
            if bucket == self._plan.last_buckets[shard]
        }
        return [last[shard] for shard in range(len(self._plan.shards))]


@dataclass
class _Computed:
    """A step whose gradients were pushed, until the replies to its pushes are read."""

    step: StepPushes
    loss: float
    metrics: dict[str, Any]
    split: dict[str, float]  # seconds: data, pull, compute (push is added once the replies are in)

    @property
    def trained_examples(self) -> int:
        """The batch's examples, unless its loss was not finite (skipped: nothing trained on)."""
        return 0 if self.step.nonfinite else self.step.examples


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
    """The Ray actor class for a worker with this reservation (two threads: run, and drain/stop)."""
    return ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=0, max_concurrency=3)(TowerWorker)
