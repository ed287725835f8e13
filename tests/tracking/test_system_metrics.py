"""System metrics per Ray node in the run, NVML without a GPU, and `towerflow gpus`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient
from support import ONE_OF_EACH, ray_actors, tracked_spec

from towerflow.launch import train
from towerflow.tracking.cluster_gpus import NodeGpus, format_table, probe_cluster
from towerflow.tracking.gpu import GpuProcess, GpuReading, NVMLMonitor, nvml, read_gpus
from towerflow.tracking.host_metrics import HostMonitor
from towerflow.tracking.system_metrics import NodeSampler, node_labels

NO_NVML = nvml() is None
HOST_METRICS = {
    "cpu_utilization_percentage",
    "system_memory_usage_megabytes",
    "system_memory_usage_percentage",
    "disk_usage_percentage",
    "network_receive_megabytes",
    "network_transmit_megabytes",
}


@pytest.mark.skipif(not NO_NVML, reason="this machine has NVML: the no-GPU path needs a machine without it")
def test_without_nvml_there_are_no_gpus_and_no_error():
    assert read_gpus() == []
    with pytest.raises(RuntimeError, match="NVML is not available"):
        NVMLMonitor()
    sampler = NodeSampler(interval_s=0.05)
    try:
        assert not sampler.has_gpus()
        metrics = sampler.drain()
    finally:
        sampler.stop()
    assert set(metrics) >= HOST_METRICS
    assert not any(name.startswith("gpu") for name in metrics)
    assert 0 <= metrics["cpu_utilization_percentage"] <= 100


def test_host_metrics_are_named_and_aggregated_as_mlflows_own_monitors():
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    ours, theirs = HostMonitor(), [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    for _ in range(3):
        for monitor in (ours, *theirs):
            monitor.collect_metrics()
    mine = ours.aggregate_metrics()
    mlflows = {k: v for monitor in theirs for k, v in monitor.aggregate_metrics().items()}
    assert set(mine) == set(mlflows) >= HOST_METRICS
    # The same readings, moments apart.
    for name in ("system_memory_usage_percentage", "disk_usage_percentage"):
        assert mine[name] == pytest.approx(mlflows[name], abs=2.0), name
    assert mine["network_receive_megabytes"] >= 0 and mine["network_transmit_megabytes"] >= 0
    ours.clear_metrics()
    assert ours.aggregate_metrics() == {}


def test_a_node_sampler_process_imports_no_mlflow():
    # One sampler process per node per run: importing MLflow there cost 1.4-2 s of CPU for nothing.
    probe = (
        "import sys\n"
        "from towerflow.tracking.system_metrics import NodeSampler\n"
        "sampler = NodeSampler(interval_s=0.05)\n"
        "assert sampler.stop()['disk_usage_percentage'] > 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'tensorflow')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_run_has_host_metrics_of_each_ray_node(ray_cluster, blob_data, tmp_path):
    spec, uri = tracked_spec(
        tmp_path,
        blob_data,
        "sys",
        cluster=ONE_OF_EACH,
        tracking={"system_metrics_interval_s": 0.2},
        training={"max_steps": 8},
    )
    run_id = train(spec).run_id
    client = MlflowClient(uri)
    names = set(client.get_run(run_id).data.metrics)
    (label,) = node_labels([n for n in ray_cluster.nodes() if n["Alive"]]).values()
    assert {f"system/{label}/{m}" for m in HOST_METRICS} <= names
    if NO_NVML:
        assert not any("/gpu_" in name for name in names)
    key = f"system/{label}/cpu_utilization_percentage"
    history = client.get_metric_history(run_id, key)
    assert [m.step for m in history] == list(range(len(history))) and history
    samplers = ray_actors("NodeSamplerActor")  # they end with the run
    assert samplers and all(a["State"] == "DEAD" for a in samplers)

    # A resumed run's samples follow the first run's: no sample number twice.
    longer = spec.model_copy(update={"training": spec.training.model_copy(update={"max_steps": 12})})
    train(longer, resume=run_id)
    steps = [m.step for m in client.get_metric_history(run_id, key)]
    assert len(steps) > len(history) and steps == list(range(len(steps)))


def test_system_metrics_can_be_turned_off(ray_cluster, blob_data, tmp_path):
    spec, uri = tracked_spec(
        tmp_path,
        blob_data,
        "nosys",
        cluster=ONE_OF_EACH,
        tracking={"system_metrics": False},
        training={"max_steps": 2},
    )
    names = MlflowClient(uri).get_run(train(spec).run_id).data.metrics
    assert "loss" in names and not any(n.startswith("system/") for n in names)


def test_gpu_probe_reaches_every_node(ray_cluster):
    nodes = probe_cluster()
    assert len(nodes) == len([n for n in ray_cluster.nodes() if n["Alive"]])
    if NO_NVML:
        assert all(not n.gpus for n in nodes)
        assert format_table(nodes) == "no GPUs in this Ray cluster (1 node)"


def test_gpu_table_layout():
    gpu = GpuReading(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-1",
        fields={
            "temperature_celsius": 41,
            "utilization_percentage": 87,
            "memory_used_megabytes": 20480,
            "memory_total_megabytes": 81559,
            "power_usage_watts": 310.4,
            "power_limit_watts": 700,
            "sm_clock_mhz": 1980,
            "ecc_errors_uncorrected": 0,
        },
        processes=[GpuProcess(pid=4242, name="python", used_memory_mb=20000)],
    )
    table = format_table([NodeGpus("10.0.0.5", "gpu-node", [gpu]), NodeGpus("10.0.0.6", "cpu-node")])
    assert table.splitlines()[0] == "gpu-node (10.0.0.5)"
    line = table.splitlines()[1]
    for part in (
        "[0] NVIDIA H100 80GB HBM3",
        "41°C",
        "? fan",
        "87 %",
        "20480 / 81559 MB",
        "310 / 700 W",
        "1980 MHz",
        "ECC 0",
        "python/4242(20000M)",
    ):
        assert part in line, part
    assert "cpu-node" not in table


def test_gpus_command_without_gpus_exits_zero(ray_cluster):
    # Against this session's cluster, as a user asks about theirs (token authentication on).
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
    }
    done = subprocess.run(
        [sys.executable, "-m", "towerflow", "gpus"], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr
    if NO_NVML:
        assert done.stdout.strip() == "no GPUs in this Ray cluster (1 node)"
