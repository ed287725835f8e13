"""`cluster.cpus_per_worker: auto`: a worker's CPUs, and so its TensorFlow's threads (tf_setup.py).

On an embedded Ray the machine is the job's, so the workers share the cores that the shards and
Ray Data leave. At one CPU each, two workers kept 2 of a machine's 16 cores busy and ran at 0.21x
single-process Keras; at 7 each the same job ran 2.3x faster (docs/gpu.md). On a Ray cluster that
this job joins, other jobs may share the nodes and placement chooses them later: one CPU, Ray's
usual share, and a line that says how to set it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from towerflow.runtime.cluster import machine_cores, runs_on_embedded_ray

log = logging.getLogger(__name__)


def auto_worker_cpus(cluster: Any, cores: int) -> int:
    """Each worker's whole share of `cores`, after the shards' and Ray Data's CPUs; at least 1.
    `cluster` is the ClusterSpec; with `ps: auto` (not counted yet) one shard is counted."""
    shards = 1 if cluster.ps == "auto" else cluster.ps
    left = cores - shards * cluster.cpus_per_ps - cluster.data_cpus
    return max(1, math.floor(left / cluster.workers + 1e-9))


def resolve_worker_cpus(spec: Any, embedded: bool | None = None) -> Any:
    """The spec with `cluster.cpus_per_worker: auto` replaced by a number of CPUs. `embedded`: whether
    the job runs on this machine's own Ray (default: `runs_on_embedded_ray()`)."""
    cluster = spec.cluster
    if cluster.cpus_per_worker != "auto":
        return spec
    if runs_on_embedded_ray() if embedded is None else embedded:
        cores = machine_cores()
        cpus = auto_worker_cpus(cluster, cores)
        log.info(
            "cluster.cpus_per_worker: auto -> %d (this machine's %d cores, less the shards' and Ray Data's, "
            "over %d workers)",
            cpus,
            cores,
            cluster.workers,
        )
    else:
        cpus = 1
        log.info(
            "cluster.cpus_per_worker: auto -> 1 on the Ray cluster joined: each worker's TensorFlow runs one "
            "thread; set cluster.cpus_per_worker to about a node's cores over the workers it holds"
        )
    return spec.model_copy(update={"cluster": cluster.model_copy(update={"cpus_per_worker": float(cpus)})})
