"""`towerflow gpus`: a gpustat-like table of every NVIDIA GPU in the Ray cluster and its processes.

One probe task per alive node, pinned there with NodeAffinitySchedulingStrategy, reads NVML
locally (ray.util.state would need the dashboard, which an embedded Ray runs without).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import ray

from towerflow.tracking.gpu import GpuReading, read_gpus


@dataclass
class NodeGpus:
    label: str  # node IP (with the node id's start where IPs repeat)
    hostname: str
    gpus: list[GpuReading] = field(default_factory=list)


@ray.remote(num_cpus=0, max_retries=0)
def _probe() -> tuple[str, list[GpuReading]]:
    return socket.gethostname(), read_gpus()


def probe_cluster(timeout_s: float = 60.0) -> list[NodeGpus]:
    """Every alive node of the connected Ray cluster with its GPUs."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from towerflow.tracking.system_metrics import node_labels

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    labels = node_labels(nodes)
    refs = {
        labels[n["NodeID"]]: _probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)
        ).remote()
        for n in nodes
    }
    replies = dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s)))
    return [NodeGpus(label, host, gpus) for label, (host, gpus) in sorted(replies.items())]


def format_table(nodes: list[NodeGpus]) -> str:
    """gpustat's layout: one line per GPU, its processes at the end of the line."""
    total = sum(len(n.gpus) for n in nodes)
    if not total:
        return f"no GPUs in this Ray cluster ({len(nodes)} node{'s' if len(nodes) != 1 else ''})"
    lines = []
    for node in nodes:
        if not node.gpus:
            continue
        lines.append(f"{node.hostname} ({node.label})")
        for gpu in node.gpus:
            f = gpu.fields
            processes = " ".join(f"{p.name}/{p.pid}({_num(p.used_memory_mb, 'M')})" for p in gpu.processes)
            lines.append(
                f"[{gpu.index}] {gpu.name:<24} | {_num(f.get('temperature_celsius'), '°C')}, "
                f"{_num(f.get('fan_speed_percentage'), ' %')} fan, {_num(f.get('utilization_percentage'), ' %')} | "
                f"{_num(f.get('memory_used_megabytes'))} / {_num(f.get('memory_total_megabytes'), ' MB')} | "
                f"{_num(f.get('power_usage_watts'))} / {_num(f.get('power_limit_watts'), ' W')} | "
                f"{_num(f.get('sm_clock_mhz'), ' MHz')} | ECC {_num(f.get('ecc_errors_uncorrected'))} | "
                f"{processes or '-'}"
            )
    return "\n".join(lines)


def _num(value: float | None, unit: str = "") -> str:
    return "?" if value is None else f"{value:.0f}{unit}"
