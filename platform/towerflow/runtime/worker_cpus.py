"""`cluster.cpus_per_worker: auto`: a worker's CPUs, and so its TensorFlow's threads (tf_setup.py).

At one CPU each, two workers kept 2 of a machine's 16 cores busy and ran at 0.21x single-process
Keras; at 7 each the same job ran 2.3x faster (docs/gpu.md). So auto gives each worker the most
whole CPUs the job can hold: on an embedded Ray, its share of the machine's cores after the shards'
and Ray Data's; on a Ray cluster joined, the most that still lets every worker, shard and Ray
Data's CPUs be placed on the nodes as they are now (their CPUs as Ray counts them) and keeps the
job within the CPUs free now, so that other jobs on the cluster keep theirs.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from towerflow.runtime.cluster import live_node_resources, machine_cores, runs_on_embedded_ray
from towerflow.runtime.elastic import workers_of_size

log = logging.getLogger(__name__)


def auto_worker_cpus(cluster: Any, cores: int) -> int:
    """Each worker's whole share of `cores`, after the shards' and Ray Data's CPUs; at least 1.
    `cluster` is the ClusterSpec."""
    left = cores - cluster.shard_processes * cluster.cpus_per_ps - cluster.data_cpus
    return max(1, math.floor(left / cluster.worker_processes + 1e-9))


def joined_worker_cpus(cluster: Any, nodes: list[dict[str, float]], free_cpus: float) -> int:
    """The most whole CPUs per worker with which the job's workers (as many as it may grow to) fit on
    `nodes` (each node's total resources, as Ray counts them) beside the shards and Ray Data, and the
    whole job within `free_cpus` (the cluster's CPUs free now); at least 1."""
    workers, shards = cluster.worker_processes, cluster.shard_processes
    biggest = max((node.get("CPU", 0.0) for node in nodes), default=0.0)
    for cpus in range(math.floor(biggest + 1e-9), 1, -1):
        asked = workers * cpus + shards * cluster.cpus_per_ps + cluster.data_cpus
        if asked <= free_cpus + 1e-9 and _workers_held(cluster, nodes, cpus, shards) >= workers:
            return cpus
    return 1


def _workers_held(cluster: Any, nodes: list[dict[str, float]], cpus: int, shards: int) -> int:
    """How many workers of `cpus` CPUs the nodes hold, each node keeping room for Ray Data's CPUs and
    its even part of the shards, wherever Ray places them: spread evenly, all on one node with
    strict_pack, one bundle a node with strict_spread (elastic workers are outside the group)."""
    hosts = [node for node in nodes if node.get("CPU", 0.0) >= 1]
    if not hosts:
        return 0
    grouped = not cluster.elastic
    pack = grouped and cluster.placement == "strict_pack"
    shards_here = shards if pack else math.ceil(shards / len(hosts))
    kept = shards_here * cluster.cpus_per_ps + cluster.data_cpus
    held = [workers_of_size(cluster, node["CPU"] - kept, node.get("GPU", 0.0), cpus) for node in hosts]
    if pack:
        return max(held)
    if grouped and cluster.placement == "strict_spread":
        return sum(min(1, count) for count in held) if len(hosts) >= cluster.worker_processes + shards else 0
    return sum(held)


def resolve_worker_cpus(spec: Any, embedded: bool | None = None) -> Any:
    """The spec with `cluster.cpus_per_worker: auto` replaced by a number of CPUs. `embedded`: whether
    the job runs on this machine's own Ray (default: `runs_on_embedded_ray()`); where it does not,
    this process must be connected to the cluster already (cluster.join_cluster)."""
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
            cluster.worker_processes,
        )
    else:
        from towerflow.runtime.actor_pool import free_for_the_next_run

        nodes = live_node_resources()
        free = free_for_the_next_run().get("CPU", 0.0)
        cpus = joined_worker_cpus(cluster, nodes, free)
        log.info(
            "cluster.cpus_per_worker: auto -> %d on the Ray cluster joined (%s; %g CPUs free): the most "
            "that still places %d workers, the shards and Ray Data's CPUs; set a number to choose",
            cpus,
            _describe_nodes(nodes),
            free,
            cluster.worker_processes,
        )
    return spec.model_copy(update={"cluster": cluster.model_copy(update={"cpus_per_worker": float(cpus)})})


def _describe_nodes(nodes: list[dict[str, float]]) -> str:
    """'3 node(s): 16, 16, 4 CPUs'."""
    sizes = sorted((node.get("CPU", 0.0) for node in nodes), reverse=True)
    return f"{len(nodes)} node(s): {', '.join(f'{size:g}' for size in sizes)} CPUs"
