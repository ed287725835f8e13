"""A node's host metrics (CPU, memory, disk, network) under MLflow's system-metrics names.

MLflow's own monitors (`mlflow.system_metrics.metrics`) are a few psutil calls each, but importing
one imports all of MLflow: 1.4-2 s of CPU on a 2-core machine (2026-11-26), paid by each node's
sampler process in every run, for nothing it uses. These read the same psutil values under the same
names and aggregate them the same way, so the MLflow UI's "System metrics" tab shows them as its
own; tests/tracking/test_system_metrics.py holds the names to MLflow's.
"""

from __future__ import annotations

import os
from collections import defaultdict

import psutil

MB = 1e6  # MLflow's system metrics count decimal megabytes


class Monitor:
    """What a node sampler asks of a monitor (the contract of MLflow's BaseMetricsMonitor):
    `collect_metrics` appends a sample, `aggregate_metrics` averages those since `clear_metrics`."""

    def __init__(self) -> None:
        self._metrics: defaultdict[str, list[float]] = defaultdict(list)

    def collect_metrics(self) -> None:
        raise NotImplementedError

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: round(sum(v) / len(v), 1) for k, v in self._metrics.items() if v}

    def clear_metrics(self) -> None:
        self._metrics.clear()


class HostMonitor(Monitor):
    """CPU and memory use, the root disk's use, and the bytes this host has received and sent
    since the monitor started (a total, not averaged, as MLflow's NetworkMonitor reports it)."""

    def __init__(self) -> None:
        super().__init__()
        psutil.cpu_percent()  # starts the interval the first sample's CPU use is measured over
        counters = psutil.net_io_counters()
        self._received_at_start = counters.bytes_recv / MB
        self._sent_at_start = counters.bytes_sent / MB
        self._network: dict[str, float] = {}

    def collect_metrics(self) -> None:
        metrics = self._metrics
        metrics["cpu_utilization_percentage"].append(psutil.cpu_percent())
        memory = psutil.virtual_memory()
        metrics["system_memory_usage_megabytes"].append(memory.used / MB)
        metrics["system_memory_usage_percentage"].append(memory.used / memory.total * 100)
        disk = psutil.disk_usage(os.sep)
        metrics["disk_usage_percentage"].append(disk.percent)
        metrics["disk_usage_megabytes"].append(disk.used / MB)
        metrics["disk_available_megabytes"].append(disk.free / MB)
        counters = psutil.net_io_counters()
        self._network = {
            "network_receive_megabytes": counters.bytes_recv / MB - self._received_at_start,
            "network_transmit_megabytes": counters.bytes_sent / MB - self._sent_at_start,
        }

    def aggregate_metrics(self) -> dict[str, float]:
        return {**super().aggregate_metrics(), **self._network}

    def clear_metrics(self) -> None:
        super().clear_metrics()
        self._network = {}
