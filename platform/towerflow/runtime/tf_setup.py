"""TensorFlow process configuration for an actor: threads from its CPU share, devices for towers
(and the GPU memory they used).

All of it must run before TensorFlow creates its context (the first op), so actors call
`configure_tensorflow` first thing in their constructor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from towerflow.runtime.cluster import machine_cores
from towerflow.runtime.scratch import use_own_scratch_dir
from towerflow.tf_import import import_tensorflow


@dataclass(frozen=True)
class TFProcessConfig:
    cpus: float = 1.0
    towers: int = 1
    gpus: int = 0
    memory_growth: bool = True
    memory_limit_mb: int | None = None
    soft_placement: bool = True
    log_device_placement: bool = False
    inter_op_threads: int | None = None  # default: 1, or 2 from 2 CPUs on
    keras: bool = True  # False where the process builds no model (a shard): TensorFlow alone

    def settings(self) -> tuple[Any, ...]:
        """What `configure_tensorflow` sets from this config: two configs with the same settings set
        a process up alike (a shard's 0.5 CPUs and 1 CPU are both one thread)."""
        threads = max(1, math.floor(self.cpus))
        inter_op = self.inter_op_threads or min(2, threads)
        devices = (self.towers, self.gpus, self.memory_growth, self.memory_limit_mb)
        return threads, inter_op, devices, self.soft_placement, self.log_device_placement, self.keras


_configured: tuple[TFProcessConfig, list[str]] | None = None  # this process's set-up, and its devices


def configure_tensorflow(config: TFProcessConfig) -> list[str]:
    """Set threads and devices; return the device names, one per tower. Also gives the process a
    temporary folder of its own (runtime/scratch.py): actors are killed, not ended, so the files
    TensorFlow writes there are removed by the next actor to start.

    Once per process: TensorFlow's threads and devices cannot change after its first op. A kept
    actor's next run (runtime/actor_pool.py) asks again with a config of the same settings and
    gets the same devices; other settings are a RuntimeError."""
    global _configured
    if _configured is None:
        _configured = (config, _configure(config))
    done, devices = _configured
    if done.settings() != config.settings():
        raise RuntimeError(f"TensorFlow in this process is set up already, for {done}, not {config}")
    return list(devices)


def _configure(config: TFProcessConfig) -> list[str]:
    use_own_scratch_dir()
    tf = import_tensorflow(gpus=config.gpus > 0, keras=config.keras)

    # The CPUs Ray gave the actor, never more threads than its node has cores (a node may declare
    # more logical CPUs to Ray than it has: the local test clusters do).
    threads = max(1, min(math.floor(config.cpus), machine_cores()))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(config.inter_op_threads or max(1, min(2, threads)))
    tf.config.set_soft_device_placement(config.soft_placement)
    tf.debugging.set_log_device_placement(config.log_device_placement)

    gpus = tf.config.list_physical_devices("GPU")
    if config.gpus and gpus:
        for gpu in gpus:
            if config.memory_limit_mb:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=config.memory_limit_mb)]
                )
            elif config.memory_growth:
                tf.config.experimental.set_memory_growth(gpu, True)
        return [f"/GPU:{i}" for i in range(len(gpus))]  # one tower per GPU Ray gave us
    if config.gpus and not gpus:
        raise RuntimeError(
            f"this worker was given {config.gpus} GPU(s) by Ray but TensorFlow sees none "
            "(is the CUDA build of TensorFlow installed on the node?)"
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    if config.towers > 1:
        # Split the CPU into logical devices so the tower path runs (and is tested) without GPUs.
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * config.towers
        )
    return [f"/CPU:{i}" for i in range(config.towers)]


def gpu_peak_mb(devices: list[str]) -> dict[str, float]:
    """Peak memory TensorFlow allocated on each GPU tower device (MiB); {} on CPUs."""
    import tensorflow as tf

    peaks = {}
    for device in devices:
        if "GPU" in device.upper():
            try:
                peaks[device] = tf.config.experimental.get_memory_info(device)["peak"] / (1 << 20)
            except (ValueError, RuntimeError):  # a device TF cannot report on
                continue
    return peaks
