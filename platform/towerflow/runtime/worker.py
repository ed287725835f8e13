"""Tower worker: a Ray actor that streams its data split, computes gradients on its towers and
talks to the parameter-server shards directly (pull parameters, push gradients).

The driver only starts `run` and drains the per-step records; no tensor passes through it.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from towerflow.runtime.batches import BatchAdapter, TowerModel, as_stream
from towerflow.runtime.sharding import VariableInfo
from towerflow.runtime.tf_setup import TFProcessConfig, configure_tensorflow


@dataclass
class WorkerConfig:
    """Everything a worker needs, in plain values (no Keras objects cross process boundaries)."""

    worker_id: int
    model_ref: str
    model_params: dict[str, Any]
    loss: str
    from_logits: bool
    metrics: list[str]
    label: str
    feature_scales: dict[str, float]
    batch_size: int
    seed: int
    tf: TFProcessConfig
    clip_global_norm: float | None = None
    drop_remainder: bool = True
    shuffle_buffer: int = 0
    step_delay_s: float = 0.0  # artificial slowness, for tests and fault benchmarks only


@dataclass
class StepRecord:
    """One gradient a worker computed and what became of it."""

    worker: int
    step: int  # global step it went into, -1 if dropped
    verdict: str
    version_read: int
    loss: float
    metrics: dict[str, float]
    examples: int
    staleness: int
    time_split: dict[str, float] = field(default_factory=dict)  # data, pull, compute, push, apply
    finished_at: float = 0.0


class TowerWorker:
    def __init__(self, config: WorkerConfig) -> None:
        devices = configure_tensorflow(config.tf)
        import keras

        from towerflow.imports import import_ref

        keras.utils.set_random_seed(config.seed)
        build = import_ref(config.model_ref)
        self.model = build(**config.model_params)
        if not self.model.trainable_variables:
            raise ValueError(
                f"{config.model_ref} built a model with no trainable variables yet; start it with keras.Input(...) "
                "so its variables exist before training"
            )
        from towerflow.runtime.towers import TowerStep

        self.config = config
        self.devices = devices
        loss_fn = keras.losses.get({"class_name": _LOSS_CLASSES[config.loss], "config": _loss_config(config)})
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

    # -- called by the driver --------------------------------------------------------------------
    def describe(self) -> tuple[list[VariableInfo], list[np.ndarray]]:
        """The trainable variables (in model order) and their initial values."""
        infos, values = [], []
        for i, var in enumerate(self.model.trainable_variables):
            value = np.asarray(var.numpy())
            infos.append(VariableInfo(i, var.path, tuple(value.shape), str(value.dtype), int(value.nbytes)))
            values.append(value)
        return infos, values

    def devices_used(self) -> list[str]:
        return list(self.devices)

    def drain(self) -> list[StepRecord]:
        records = []
        while self._records:
            records.append(self._records.popleft())
        return records

    def request_stop(self) -> None:
        self._stop.set()

    def run(
        self, shards: list[Any], placement: list[list[tuple[int, int, int, bool]]], data: Any
    ) -> dict[str, Any]:
        """Train until the data ends, the shards say the last step is done, or the driver stops us.

        `placement[s]` lists shard s's pieces as (variable index, start row, stop row, whole?).
        """
        cfg = self.config
        variables = self.model.trainable_variables
        # Slices of a cut variable are gathered in a reusable buffer, then assigned in one op
        # (a sliced assign per piece costs several times more).
        staging = {
            index: np.empty(variables[index].shape, dtype=np.dtype(variables[index].dtype))
            for pieces in placement
            for index, _, _, whole in pieces
            if not whole
        }
        start = time.perf_counter()
        replies = ray.get([shard.pull.remote(0) for shard in shards])
        versions = [r.version for r in replies]
        param_refs = [r.params for r in replies]
        done = any(r.done for r in replies)
        stream = as_stream(data)
        self.adapter.varlen = stream.options.varlen
        if stream.options.tower_preprocess:
            self.towers.model = TowerModel(self.model, stream.options.tower_preprocess)
        batches = stream.batches(
            batch_size=cfg.batch_size,
            drop_last=cfg.drop_remainder,
            shuffle_buffer=cfg.shuffle_buffer,
            seed=cfg.seed + cfg.worker_id,
        )
        steps = examples = 0
        try:
            while not done and not self._stop.is_set():
                t0 = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break
                inputs, labels = self.adapter(batch)
                t1 = time.perf_counter()
                for shard_values, pieces in zip(ray.get(param_refs), placement):
                    for value, (index, start, stop, whole) in zip(shard_values, pieces):
                        if whole:
                            variables[index].assign(value)
                        else:
                            staging[index][start:stop] = value
                for index, buffer in staging.items():
                    variables[index].assign(buffer)
                t2 = time.perf_counter()
                loss, metrics, grads = self.towers(inputs, labels)
                grads = [g.numpy() for g in grads]
                loss = float(loss)
                if cfg.step_delay_s:
                    time.sleep(cfg.step_delay_s)
                t3 = time.perf_counter()
                pushes = [
                    shard.push.remote(
                        [grads[i] if whole else grads[i][start:stop] for i, start, stop, whole in pieces],
                        version,
                        cfg.worker_id,
                    )
                    for shard, pieces, version in zip(shards, placement, versions)
                ]
                replies = ray.get(pushes)
                t4 = time.perf_counter()
                lead = replies[0]
                verdict = lead.verdict if all(r.verdict == lead.verdict for r in replies) else "partial"
                self._records.append(
                    StepRecord(
                        worker=cfg.worker_id,
                        step=lead.step,
                        verdict=verdict,
                        version_read=versions[0],
                        loss=loss,
                        metrics={k: float(v) for k, v in metrics.items()},
                        examples=int(labels.shape[0]),
                        staleness=max(r.staleness for r in replies),
                        time_split={
                            "data": t1 - t0,
                            "pull": t2 - t1,
                            "compute": t3 - t2,
                            "push": t4 - t3,
                            "apply": max(r.apply_s for r in replies),
                        },
                        finished_at=time.time(),
                    )
                )
                steps += 1
                examples += int(labels.shape[0])
                versions = [r.next.version for r in replies]
                param_refs = [r.next.params for r in replies]
                done = any(r.next.done for r in replies)
        finally:
            # Let sync aggregation go on without us (also when we failed).
            ray.get([shard.retire.remote(cfg.worker_id) for shard in shards])
        return {
            "worker": cfg.worker_id,
            "steps": steps,
            "examples": examples,
            "seconds": time.perf_counter() - start,
        }


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
