"""Faults on a real multi-node Ray cluster (tests/multinode.py), the driver run as users run it
(`python -m towerflow train` with RAY_ADDRESS): a node holding a worker is lost (its raylet killed);
the driver itself is SIGKILLed and `--resume auto` continues its run; an elastic run grows onto a
node that joins, shrinks when that node is lost, and shrinks again on `towerflow scale`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient
from multinode import LocalCluster, cluster_spec_file, multinode_cluster_fixture  # noqa: F401

pytestmark = pytest.mark.timeout(600)


def _spec_file(
    tmp_path: Path, blob_data: Path, name: str, cluster: dict | None = None, **training
) -> tuple[Path, str]:
    return cluster_spec_file(
        tmp_path,
        blob_data,
        name,
        cluster={
            "workers": 2,
            "ps": 1,
            "cpus_per_worker": 1,
            "cpus_per_ps": 0.5,
            "data_cpus": 0.5,
            **(cluster or {}),
        },
        training={"mode": "sync", "optimizer": {"name": "sgd", "learning_rate": 0.05}, **training},
        supervision={"checkpoint": {"every_steps": 20}, "log_every_steps": 5},
    )


def _train(cluster: LocalCluster, spec: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "towerflow", "train", str(spec), "--no-progress", *args],
        cwd=REPO,
        env={**cluster.env(), "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for_step(
    uri: str, experiment: str, step: int, driver: subprocess.Popen, timeout: float = 240
) -> str:
    """The run's id once MLflow shows `global_step` >= step (the driver flushes every 2 s)."""
    client = MlflowClient(uri)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.poll() is not None:
            raise AssertionError(f"the driver exited with {driver.returncode}:\n{driver.stdout.read()}")
        found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([found.experiment_id]) if found else []
        if runs and runs[0].data.metrics.get("global_step", 0) >= step:
            return runs[0].info.run_id
        time.sleep(0.5)
    raise TimeoutError(f"no step {step} within {timeout:.0f} s")


def _actors(cluster: LocalCluster, class_name: str) -> list[dict]:
    reply = cluster.state_api("/api/v0/actors?limit=1000&detail=true")
    return [
        a
        for a in reply["data"]["result"]["result"]
        if a["class_name"] == class_name and a["state"] == "ALIVE"
    ]


def _finish(driver: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = driver.communicate(timeout=timeout)
    assert driver.returncode == 0, out
    return out


def test_a_lost_node_costs_its_worker_which_a_new_node_takes_over(multinode_cluster, blob_data, tmp_path):
    cluster = multinode_cluster
    spec, uri = _spec_file(tmp_path, blob_data, "node-loss", max_steps=150)
    driver = _train(cluster, spec)
    run_id = _wait_for_step(uri, "node-loss", 20, driver)
    head = cluster.head.node_id
    shard_nodes = {a["node_id"] for a in _actors(cluster, "ParameterShard")}
    victims = [
        node
        for node in cluster.nodes
        if not node.killed
        and node.node_id not in shard_nodes | {head}
        and any(a["node_id"] == node.node_id for a in _actors(cluster, "TowerWorker"))
    ]
    if not victims:
        driver.kill()
        pytest.skip(
            f"Ray placed no worker apart from the shards and the head: {json.dumps(_actors(cluster, 'TowerWorker'))}"
        )
    cluster.kill_node(victims[0])  # the nodes left have room for the replacement
    out = _finish(driver)
    assert "worker" in out and "replaced" in out
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["global_step"] == 150
    faults = {k: v for k, v in run.data.tags.items() if k.startswith("towerflow.fault.")}
    assert run.data.metrics["workers_lost"] == 1, (
        faults,
        out[-3000:],
    )  # its replacement waited for a live node
    assert any("replaced" in v for v in faults.values()), faults


def test_a_killed_driver_is_continued_by_resume_auto(multinode_cluster, blob_data, tmp_path):
    cluster = multinode_cluster
    spec, uri = _spec_file(tmp_path, blob_data, "driver-loss", max_steps=100)
    driver = _train(cluster, spec, "--resume", "auto")  # nothing to resume yet: a new run
    run_id = _wait_for_step(uri, "driver-loss", 30, driver)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver's process, as a lost head pod would lose it
    driver.wait()
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "RUNNING"  # nobody closed it
    again = _finish(_train(cluster, spec, "--resume", "auto"))
    assert f"continuing run {run_id}" in again
    experiment = client.get_experiment_by_name("driver-loss")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["global_step"] == 100
    assert int(run.data.tags["towerflow.resumed_from_step"]) >= 20


def _wait_for_metric(uri: str, run_id: str, key: str, value: float, driver, timeout: float = 180) -> None:
    client = MlflowClient(uri)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.poll() is not None:
            raise AssertionError(f"the driver exited with {driver.returncode}:\n{driver.stdout.read()}")
        if client.get_run(run_id).data.metrics.get(key) == value:
            return
        time.sleep(0.5)
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
    driver.kill()
    out = driver.communicate()[0][-6000:]
    raise TimeoutError(
        f"{key} never became {value} within {timeout:.0f} s: {history}; the driver said:\n{out}"
    )


def test_an_elastic_run_grows_onto_a_new_node_shrinks_when_it_is_lost_and_on_towerflow_scale(
    multinode_cluster, blob_data, tmp_path
):
    cluster = multinode_cluster
    # 1.5 CPUs a worker: a 2-CPU node holds one, beside a shard or Ray Data's share.
    elastic = {"workers": {"min": 1, "max": 4}, "cpus_per_worker": 1.5}
    spec, uri = _spec_file(tmp_path, blob_data, "elastic", cluster=elastic, max_steps=100_000)
    driver = _train(cluster, spec)
    run_id = _wait_for_step(uri, "elastic", 10, driver)
    client = MlflowClient(uri)
    started = client.get_run(run_id).data.metrics["workers"]
    assert 1 <= started < 4
    node = cluster.add_node(num_cpus=2)  # room for one more worker: the waiting spare starts there
    _wait_for_metric(uri, run_id, "workers", started + 1, driver)
    cluster.kill_node(node)  # its worker is lost; the run goes on without it
    _wait_for_metric(uri, run_id, "workers", started, driver)
    scale = subprocess.run(
        [sys.executable, "-m", "towerflow", "scale", run_id, "--workers", "1"],
        cwd=REPO,
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert scale.returncode == 0, scale.stdout + scale.stderr
    _wait_for_metric(uri, run_id, "workers", 1.0, driver)
    step = client.get_run(run_id).data.metrics["global_step"]
    _wait_for_step(uri, "elastic", step + 10, driver)  # and trains on
    os.killpg(driver.pid, signal.SIGTERM)
    out, _ = driver.communicate(timeout=120)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED", out
    assert run.data.metrics["workers_lost"] == 1
    assert any(
        k.startswith("towerflow.fault.") and "went on without it" in v for k, v in run.data.tags.items()
    )
    history = [m.value for m in sorted(client.get_metric_history(run_id, "workers"), key=lambda m: m.step)]
    assert history == [started, started + 1, started, 1.0]
