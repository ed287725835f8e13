"""A worker's training loop: load the parameters, compute a batch on the towers, push each gradient
bucket to its shards from inside the backward pass, and record what became of the step.

The worker actor (worker.py) builds the model and answers the driver; this loop is what it runs
between `run`'s start and end. It outlives one run (a resize or a rollback starts the next on the
same loop), so that the towers keep their traced step: the push hook is this loop's own method.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from towerflow.runtime.actors import ACTOR_GONE
from towerflow.runtime.batches import BatchAdapter
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.pushes import PushPlan, StepPushes
from towerflow.runtime.shard_replies import parameter_values
from towerflow.runtime.shared_buffers import assign_pulled
from towerflow.runtime.step_profiler import StepWindowProfiler
from towerflow.runtime.towers import TowerStep, signature_of
from towerflow.runtime.user_errors import misfit_error
from towerflow.runtime.worker_config import WorkerConfig
from towerflow.runtime.worker_messages import StepRecord, WarmUp, WorkerReport

# Drained records are kept this long: the driver that drained them may be lost before it logged
# them (its tracker ships every few seconds), and a new driver logs them (runtime/run_keeper.py).
RECENT_S = 30.0


class StepLoop:
    """One worker's steps: the push hook the towers call, the loop, and the records the driver drains."""

    def __init__(
        self,
        config: WorkerConfig,
        model: Any,
        towers: TowerStep,
        adapter: BatchAdapter,
        profiler: StepWindowProfiler,
    ) -> None:
        import tensorflow as tf  # already imported by the worker that builds the model

        self.config = config
        self.model = model
        self.towers = towers
        self.adapter = adapter
        self.stop = threading.Event()
        self._run_number = self._stopped_run = 0  # the current run, the last one asked to stop
        self.warm_up: WarmUp | None = None  # what a spare needs to trace ahead, from the first batch
        self._variables = model.trainable_variables  # fixed once built; read every step
        self._profiler = profiler
        # what a batch that does not fit the model raises (at the first step: the spec's mismatch)
        self._misfit_errors = (ValueError, TypeError, tf.errors.InvalidArgumentError)
        self._faults = config.faults or FaultInjector()
        self._records: collections.deque[StepRecord] = collections.deque()
        self._recent: collections.deque[StepRecord] = collections.deque()  # drained, kept RECENT_S
        self._plan: PushPlan | None = None
        self._bucket_variables: list[list[int]] = []
        self._step: StepPushes | None = None  # the step in progress, as the push hook sees it
        self._incarnation = 0  # the run's own number, under which it joins the shards' steps
        self._busy_since: float | None = None  # when the current step's own work began (monotonic)
        self._waiting_since: float | None = None  # when it began waiting for the batch in hand

    def assume(self, config: WorkerConfig, profiler: StepWindowProfiler) -> None:
        """Run under a lost worker's `config` from now on (a warm spare taking its place). The loop
        stays, and with it the push hook its towers traced the step with: a new loop's hook would
        have them trace it again."""
        self.config, self._profiler = config, profiler
        self._faults = config.faults or FaultInjector()

    def attach(self, plan: PushPlan) -> None:
        """Push with `plan` from now on: the towers call this loop's hook for each of its buckets."""
        self._plan = plan
        self._bucket_variables = plan.bucket_variables
        self.towers.push_in_buckets(self._bucket_variables, self._push_bucket)

    def new_run(self, run_number: int) -> threading.Event:
        """A fresh stop event for run `run_number` (the last run's readers end with the old one),
        set already if that run was asked to stop before it began (`request_stop`)."""
        time.sleep(self._faults.run_start_delay(self.config.worker_id))
        self._run_number = run_number  # before the fresh event; request_stop reads it after setting
        self.stop = threading.Event()
        if self._stopped_run == run_number:
            self.stop.set()
        return self.stop

    @property
    def run_number(self) -> int:
        """The current run's number (the last one's, between runs)."""
        return self._run_number

    def request_stop(self, run_number: int) -> None:
        """Stop run `run_number` after its step, even one not begun yet: the worker's calls run on
        threads, so a stop sent after a run may start first (a replacement's, stopped as it starts)."""
        self._stopped_run = run_number
        if self._run_number == run_number:
            self.stop.set()

    def drain(self) -> WorkerReport:
        records = []
        while self._records:
            records.append(self._records.popleft())
        self._recent.extend(records)
        kept_from = time.time() - RECENT_S
        while self._recent and self._recent[0].finished_at < kept_from:
            self._recent.popleft()
        now, busy, waiting = time.monotonic(), self._busy_since, self._waiting_since
        return WorkerReport(
            records, None if busy is None else now - busy, None if waiting is None else now - waiting
        )

    def recent_records(self) -> list[StepRecord]:
        """The records of the last `RECENT_S` seconds, drained or not (it drains): those a lost
        driver may not have logged, and those of steps taken after it was lost."""
        self.drain()
        return list(self._recent)

    def run(self, batches: Iterator[Any], tower_preprocess: list[str]) -> tuple[int, int]:
        """Train on `batches` with the attached plan until they end, the shards say the last step is
        done, or the driver stops us; returns (steps, examples) trained."""
        cfg, shards = self.config, self._plan.shards
        placement = self._plan.placement
        # A replacement takes its predecessor's place in every step still to aggregate; the shards
        # drop a push of any other incarnation of this worker id (a lost one's, late).
        self._incarnation = incarnation = secrets.randbits(62)
        ray.get([shard.join.remote(cfg.worker_id, incarnation) for shard in shards])
        replies = ray.get([shard.pull.remote(cfg.start_at_step) for shard in shards])
        versions = [r.version for r in replies]
        fresh = replies  # parameters not yet loaded into the model (None: the model holds the last)
        done = any(r.done for r in replies)
        steps = computed = examples = 0
        inflight: _Computed | None = None  # overlap_push: the step whose push is still on its way
        retire = True
        try:
            while not done and not self.stop.is_set():
                self._profiler.at_step(versions[0] + 1)
                self._waiting_since = time.monotonic()
                if computed:  # start-up (first batch, graph tracing) is not counted against the timeout
                    self._busy_since = self._waiting_since
                t0 = time.perf_counter()
                batch = next(batches, None)
                self._waiting_since = None
                if batch is None:
                    break
                inputs, labels = self.adapter(batch)
                rows = int(labels.shape[0])
                if self.warm_up is None and rows == cfg.batch_size:  # a whole batch, as most are
                    self.warm_up = WarmUp(signature_of(inputs, labels), list(tower_preprocess))
                t1 = time.perf_counter()
                if fresh is not None:
                    assign_pulled(self._variables, parameter_values(fresh), placement)
                    fresh = None
                t2 = time.perf_counter()
                # Downpour's n_fetch: new parameters with every fetch_every-th step's replies; the
                # steps in between compute on these (the shards count their staleness).
                step = StepPushes(
                    versions,
                    rows,
                    fetch=(computed + 1) % cfg.fetch_every == 0,
                    number=computed if cfg.overlap_push else None,  # two of its pushes in flight
                )
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
        except (*ACTOR_GONE, ray.exceptions.ObjectLostError):
            # A call to a shard failed: the controller retires us as it replaces us, or rolls the
            # shards back. Retiring here could let a shard close a step with our gradient alone
            # and drop the others' as stale, a step no worker then reports.
            retire = False
            raise
        finally:
            self._busy_since = self._waiting_since = None
            self._profiler.stop()
            # Let sync aggregation go on without us (also when our own code failed).
            if retire:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get([shard.retire.remote(cfg.worker_id, incarnation) for shard in shards])
        return steps, examples

    # -- one step --------------------------------------------------------------------------------
    def _injected_loss(self, step: StepPushes, loss: float) -> float:
        """The loss, or NaN where a test's fault injector says so."""
        return self._faults.loss(self.config.worker_id, step.global_step, loss)

    def _push_bucket(self, bucket: int, loss: np.ndarray, *gradients: np.ndarray) -> np.int64:
        """Push hook, called by the tower graph (on one of TensorFlow's threads) for each bucket.

        It never pushes a gradient whose loss is not finite, nor one that holds a NaN/inf itself
        (a finite loss can have such gradients: sqrt(0), an overflow that clipping spreads to every
        gradient): the NaN guard. Buckets come in order, so a bad one stops the step's pushes from
        there on. It never raises into TensorFlow: an error is kept for the worker to raise once
        the step returns.
        """
        step, cfg = self._step, self.config
        if step is None or step.nonfinite or step.error is not None:
            return np.int64(0)
        try:
            if cfg.nan_guard and not (
                np.isfinite(self._injected_loss(step, float(loss))) and _all_finite(gradients)
            ):
                step.nonfinite = True
                if cfg.skip_nonfinite:  # the shards count this worker in the step, with no gradient
                    for bucket_id in range(bucket, len(self._bucket_variables)):
                        sent = self._plan.send(
                            bucket_id,
                            None,
                            step.versions,
                            self._pusher,
                            step.examples,
                            step.fetch,
                            step.number,
                        )
                        for shard, ref in sent:
                            step.sent.append((shard, bucket_id, ref))
                return np.int64(0)
            if bucket == 0 and self._faults.delay(cfg.worker_id):
                time.sleep(self._faults.delay(cfg.worker_id))
            by_variable = dict(zip(self._bucket_variables[bucket], gradients, strict=True))
            versions = self._faults.versions_pushed(cfg.worker_id, step.versions)
            for shard, ref in self._plan.send(
                bucket, by_variable, versions, self._pusher, step.examples, step.fetch, step.number
            ):
                step.sent.append((shard, bucket, ref))
        except BaseException as exc:  # noqa: BLE001 - handed to the worker's own thread
            step.error = exc
        return np.int64(0)

    @property
    def _pusher(self) -> tuple[int, int]:
        return self.config.worker_id, self._incarnation

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
        self._faults.check_shard_call(worker, step.global_step)
        every = ray.get([ref for _, _, ref in step.sent])
        waited = time.perf_counter() - began
        replies = self._completing_replies(step, every)
        self._faults.check_record(worker, step.global_step)
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


def _all_finite(arrays: tuple[np.ndarray, ...]) -> bool:
    """Whether every value is finite: a sum is NaN/inf where one is (one pass, no mask array;
    only gradients near float32's limit could overflow it, and they are as good as infinite)."""
    return all(np.isfinite(np.sum(array)) for array in arrays)
