"""What a worker needs, in plain values (no Keras objects cross process boundaries), and how the
driver makes it from the job spec."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.tf_setup import TFProcessConfig


@dataclass
class WorkerConfig:
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
    start_at_step: int = 0  # GlobalStepWaiter: wait for this global step before the first step
    nan_guard: bool = True  # never push a gradient whose loss is not finite; report it instead
    profile_steps: tuple[int, int] | None = None  # profile global steps [a, b) with TF's profiler
    skip_nonfinite: bool = False  # nan_guard: skip: drop a non-finite gradient and go on training
    faults: FaultInjector | None = None  # slowness or NaN losses a test injects (runtime/faults.py)
    fetch_every: int = 1  # async: take new parameters every this many steps (Downpour's n_fetch)
    overlap_push: bool = False  # async: read a push's reply after the next step's compute
    # A spare: node id -> the ref of readying a process there for the next pipeline's read tasks
    # (data/reader_warmup.py), called as it starts; its `warm_up` waits for it.
    ready_node_for_reading: Callable[[str], Any] | None = None

    def built_alike(self, other: WorkerConfig) -> bool:
        """Whether a worker built under `other` (its model, towers, batch adapter and TensorFlow
        set-up) can run under this config as it is (`TowerWorker.assume`)."""
        return all(getattr(self, name) == getattr(other, name) for name in _BUILT_WITH)


# What a worker's start fixes: a config that differs in any of these needs a new worker.
_BUILT_WITH = (
    "model_ref",
    "model_params",
    "loss",
    "from_logits",
    "metrics",
    "label",
    "feature_scales",
    "tf",
    "clip_global_norm",
)


def worker_config(
    spec: Any,
    worker_id: int,
    *,
    feature_scales: dict[str, float],
    start_step: int,
    faults: FaultInjector | None,
    push_in_buckets: bool,
) -> WorkerConfig:
    """Worker `worker_id`'s config for `spec` (a JobSpec); `start_step` is the run's first global step."""
    supervision = spec.supervision
    profile = supervision.profile
    share = spec.cluster.gpus_per_worker
    # A fractional share (two workers on one GPU) still trains on that GPU; each worker's TensorFlow
    # must then grow its memory, or the first to start reserves the card and the next cannot.
    sharing_gpu = 0 < share < 1 and spec.tf_config.memory_limit_mb is None
    return WorkerConfig(
        worker_id=worker_id,
        model_ref=spec.model.ref,
        model_params=dict(spec.model.params),
        loss=spec.model.loss,
        from_logits=spec.model.from_logits,
        metrics=list(spec.model.metrics),
        label=spec.data.train.label,
        feature_scales=feature_scales,
        batch_size=spec.data.batch_size,
        seed=spec.training.seed,
        tf=TFProcessConfig(
            cpus=spec.cluster.cpus_per_worker,
            towers=spec.cluster.towers,
            gpus=math.ceil(share),
            memory_growth=spec.tf_config.memory_growth or sharing_gpu,
            memory_limit_mb=spec.tf_config.memory_limit_mb,
            soft_placement=spec.tf_config.soft_placement,
            log_device_placement=spec.tf_config.log_device_placement,
            # A second inter-op thread runs the gradient-push hooks beside the backward pass.
            inter_op_threads=2 if push_in_buckets else None,
        ),
        clip_global_norm=spec.training.optimizer.clip_global_norm,
        drop_remainder=spec.data.drop_remainder,
        shuffle_buffer=spec.data.shuffle_buffer,
        start_at_step=start_step + worker_id * supervision.worker_start_delay_steps,
        nan_guard=supervision.nan_guard != "off",
        skip_nonfinite=supervision.nan_guard == "skip",
        faults=faults,
        fetch_every=spec.training.fetch_every,
        overlap_push=spec.training.overlap_push,
        profile_steps=(
            (profile.start_step, profile.stop_step)
            if profile is not None and worker_id in profile.workers
            else None
        ),
    )
