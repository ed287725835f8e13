"""System metrics of every Ray node, in the job's MLflow run as `system/<node>/<metric>`.

One small actor per alive node (no CPU reserved, pinned with NodeAffinitySchedulingStrategy)
samples the host's CPU, memory, disk and network (towerflow.tracking.host_metrics: the process
imports no MLflow), plus every NVIDIA GPU through NVML (towerflow.tracking.gpu) where there is one.
The driver drains the nodes' aggregated samples and logs them itself, so the store has one writer
and remote nodes need no access to it. The names follow MLflow's system metrics (`system/` prefix,
node id after it: what MLFLOW_SYSTEM_METRICS_NODE_ID does), so the run page's "System metrics" tab
shows them, with step = sample number per node.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import ray

from towerflow.tracking.gpu import NVMLMonitor, nvml
from towerflow.tracking.host_metrics import HostMonitor, Monitor

PREFIX = "system"


class NodeSampler:
    """Samples this node's monitors every `interval_s` in a thread; `drain` averages what it has."""

    def __init__(self, interval_s: float) -> None:
        self.monitors: list[Monitor] = [HostMonitor()]
        self.gpus = nvml() is not None
        if self.gpus:
            self.monitors.append(NVMLMonitor())
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="towerflow-system-metrics", daemon=True)
        self._thread.start()

    def has_gpus(self) -> bool:
        return self.gpus

    def drain(self) -> dict[str, float] | None:
        """The averages since the previous drain (None before the first sample), then start afresh."""
        with self._lock:
            if not self._samples:
                self._sample()
            metrics: dict[str, float] = {}
            for monitor in self.monitors:
                metrics.update(monitor.aggregate_metrics())
                monitor.clear_metrics()
            self._samples = 0
        return {k: float(v) for k, v in metrics.items()} or None

    def stop(self) -> dict[str, float] | None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        return self.drain()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._sample()
            self._stop.wait(self.interval_s)

    def _sample(self) -> None:
        for monitor in self.monitors:
            with contextlib.suppress(Exception):  # a monitor that fails once just misses that sample
                monitor.collect_metrics()
        self._samples += 1


@ray.remote(num_cpus=0, max_restarts=0)
class NodeSamplerActor(NodeSampler):
    pass


def node_labels(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """Ray node id -> metric label: the node's IP, with the id's start added where IPs repeat."""
    ips = [n["NodeManagerAddress"] for n in nodes]
    return {
        n["NodeID"]: n["NodeManagerAddress"]
        if ips.count(n["NodeManagerAddress"]) == 1
        else f"{n['NodeManagerAddress']}-{n['NodeID'][:8]}"
        for n in nodes
    }


class ClusterSystemMetrics:
    """Driver side: starts one sampler per alive Ray node and drains them every interval in a thread
    of its own, turning the drains into MLflow metrics that `poll` hands over. The thread, not the
    driver's loop, waits on Ray: a sampler whose node went with a lost head is waited on until the
    GCS is back (runtime/head_watch.py)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.samplers: dict[str, Any] = {}  # label -> actor
        self._steps: dict[str, int] = {}
        self._collected: list[Any] = []  # MLflow Metrics drained, not yet polled
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, first_steps: dict[str, int] | None = None) -> None:
        """`first_steps`: per node label, the sample number to go on from (a resumed run's)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        for node_id, label in node_labels(nodes).items():
            strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            self.samplers[label] = NodeSamplerActor.options(scheduling_strategy=strategy).remote(
                self.interval_s
            )
            self._steps[label] = (first_steps or {}).get(label, 0)
        self._thread = threading.Thread(
            target=self._keep_draining, name="towerflow-node-metrics", daemon=True
        )
        self._thread.start()

    def poll(self) -> list[Any]:
        """MLflow Metric objects of the drains that came back since the last poll; never waits."""
        with self._lock:
            metrics, self._collected = self._collected, []
        return metrics

    def stop(self, timeout_s: float = 10.0) -> list[Any]:
        """The last samples of every node; the samplers are gone afterwards."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._collect({actor.stop.remote(): label for label, actor in self.samplers.items()}, timeout_s)
        for actor in self.samplers.values():
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.samplers = {}
        return self.poll()

    def _keep_draining(self) -> None:
        while not self._stop.wait(self.interval_s):
            # a node that does not answer within the interval is not waited for again
            self._collect(
                {actor.drain.remote(): label for label, actor in self.samplers.items()}, self.interval_s
            )

    def _collect(self, pending: dict[Any, str], timeout: float) -> None:
        from mlflow.entities import Metric

        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        now_ms = int(time.time() * 1000)
        for ref in ready:
            label = pending[ref]
            try:
                values = ray.get(ref)
            except Exception:  # a node went away: its metrics stop, the run goes on
                continue
            if not values:
                continue
            with self._lock:
                step = self._steps[label]
                self._steps[label] = step + 1
                self._collected.extend(
                    Metric(f"{PREFIX}/{label}/{k}", v, now_ms, step) for k, v in sorted(values.items())
                )


def next_sample_steps(client: Any, run_id: str) -> dict[str, int]:
    """Per node label, one past the last sample number the run already has: a resumed run's
    samples then follow its earlier ones instead of overwriting their steps."""
    latest = client.get_run(run_id).data.metrics
    one_per_label: dict[str, str] = {}
    for key in sorted(latest):
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == PREFIX:
            one_per_label.setdefault(parts[1], key)
    return {
        label: max(m.step for m in client.get_metric_history(run_id, key)) + 1
        for label, key in one_per_label.items()
    }
