"""Drivers run as users run them on the multi-node test cluster (`python -m towerflow train` with
RAY_ADDRESS), and what the cluster's state API and MLflow say of them: the helpers of
the test_multinode_*.py modules' fault tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from conftest import REPO
from mlflow.tracking import MlflowClient
from multinode import LocalCluster, cluster_spec_file
from multinode_clients import END_RUNS_CLIENT, HOLD_NODE_CLIENT
from node_processes import Node
from process_stacks import communicate_or_explain
from tracking_server import process_tree


def client_report(cluster: LocalCluster, source: str, *args: str) -> dict:
    """Run a client script on the cluster; the JSON on its last line of output."""
    client = subprocess.Popen(
        [sys.executable, "-c", source, *args],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = communicate_or_explain(client, timeout=120)
    assert client.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def node_held(cluster: LocalCluster, node: Node) -> Iterator[None]:
    """Every CPU of `node` held by a client's actor meanwhile: a run started then places nothing there."""
    client = subprocess.Popen(
        [sys.executable, "-c", HOLD_NODE_CLIENT, node.node_id],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        line = client.stdout.readline()
        assert line.startswith('{"held"'), line + client.stdout.read()
        yield
    finally:
        client.kill()
        client.wait()


def spec_file(
    tmp_path: Path,
    blob_data: Path,
    name: str,
    cluster: dict | None = None,
    checkpoint_every: int = 20,
    **training,
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
        supervision={"checkpoint": {"every_steps": checkpoint_every}, "log_every_steps": 5},
    )


def start_driver(cluster: LocalCluster, spec: Path, *args: str) -> subprocess.Popen:
    """`towerflow train` on the cluster, as a user runs it (its driver joins the head's raylet)."""
    return _towerflow(cluster, train_command(spec, *args))


def start_driver_on(cluster: LocalCluster, node: Node, spec: Path, *args: str) -> subprocess.Popen:
    """`towerflow train` with its driver on `node` (`train_command`)."""
    return _towerflow(cluster, train_command(spec, *args, node=node))


# A driver joined to one node's raylet: `ray.init` picks the node by its temp dir, then the command
# runs in the same process (its Ray already joined).
_DRIVER_ON_NODE = (
    "import sys, ray; ray.init(_temp_dir=sys.argv[1]); from towerflow.cli.main import run; "
    "sys.argv = ['towerflow', *sys.argv[2:]]; run()"
)


def train_command(spec: Path, *args: str, node: Node | None = None) -> list[str]:
    """The argv of `towerflow train SPEC --no-progress ARGS`; with `node`, its driver on that node,
    as a driver in a worker pod of its own is on Kubernetes. On one machine Ray joins a driver to
    the head's raylet, whichever node it starts from (it prefers the head among the raylets of the
    host): this one names its node. Its command runs no driver of its own (`driver_restarts` 0 in
    `spec`: a restarted child would join the head)."""
    train = ["train", str(spec), "--no-progress", *args]
    if node is None:
        return [sys.executable, "-m", "towerflow", *train]
    return [sys.executable, "-c", _DRIVER_ON_NODE, node.temp_dir, *train]


_started: list[subprocess.Popen] = []  # every driver's command started here (`end_leftover_runs`)


def _towerflow(cluster: LocalCluster, args: list[str]) -> subprocess.Popen:
    command = subprocess.Popen(
        args,
        cwd=REPO,
        env={**cluster.env(), "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _started.append(command)
    return command


def end_leftover_runs(cluster: LocalCluster) -> list[str]:
    """After a failed test on its module's cluster: kill the drivers still running and end the runs
    left on the cluster, which would otherwise keep their shards and workers (and the cores they
    hold) for `driver_grace_s`, failing the module's next test for want of room. What it ended."""
    left = [command for command in _started if command.poll() is None]
    for command in left:
        for process in process_tree(command.pid):  # with a driver it runs: a child
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        command.wait()
    _started.clear()
    return [f"driver pid {command.pid}" for command in left] + client_report(cluster, END_RUNS_CLIENT)


def wait_for_step(
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


def alive_actors(cluster: LocalCluster, class_name: str) -> list[dict]:
    reply = cluster.state_api("/api/v0/actors?limit=1000&detail=true")
    return [
        a
        for a in reply["data"]["result"]["result"]
        if a["class_name"] == class_name and a["state"] == "ALIVE"
    ]


KEPT = ("ParameterShard", "TowerWorker")  # a run's actors that outlive its driver, or the head


def kept_actors(cluster: LocalCluster) -> dict[str, int]:
    """The run's shards and workers alive now: actor id -> pid."""
    return {a["actor_id"]: a["pid"] for kind in KEPT for a in alive_actors(cluster, kind)}


def nodes_with_a_worker_and_no_shard(cluster: LocalCluster) -> list[Node]:
    """Live nodes, the head aside, that hold a worker of the run and none of its shards: a node
    whose loss costs a worker only."""
    shard_nodes = {a["node_id"] for a in alive_actors(cluster, "ParameterShard")}
    worker_nodes = {a["node_id"] for a in alive_actors(cluster, "TowerWorker")}
    return [n for n in cluster.nodes[1:] if not n.killed and n.node_id in worker_nodes - shard_nodes]


def kept_actor_states(cluster: LocalCluster) -> list[tuple]:
    """Every shard and worker the GCS lists, dead ones too: (class, state, pid, death cause), to
    say in a failure what became of a run's actors."""
    reply = cluster.state_api("/api/v0/actors?limit=1000&detail=true")
    return [
        (a["class_name"], a["state"], a["pid"], (a.get("death_cause") or {}))
        for a in reply["data"]["result"]["result"]
        if a["class_name"] in KEPT
    ]


def placement_groups(cluster: LocalCluster, job: str) -> list[dict]:
    """The job's placement groups that still hold their resources."""
    reply = cluster.state_api("/api/v0/placement_groups?limit=1000&detail=true")
    return [
        g
        for g in reply["data"]["result"]["result"]
        if g["name"].startswith(f"towerflow-{job}-") and g["state"] != "REMOVED"
    ]


def finish(driver: subprocess.Popen, timeout: float = 300) -> str:
    out = communicate_or_explain(driver, timeout)
    assert driver.returncode == 0, out
    return out


def stop(driver: subprocess.Popen, timeout: float = 120) -> str:
    """Stop the run as `ray job stop` does (SIGTERM to the command's process group); its output."""
    os.killpg(driver.pid, signal.SIGTERM)
    return communicate_or_explain(driver, timeout)


def wait_for_metric(uri: str, run_id: str, key: str, value: float, driver, timeout: float = 180) -> None:
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


def wait_for_fault(uri: str, run_id: str, text: str, driver, timeout: float = 60) -> str:
    """The run's first fault tag that says `text`, once MLflow has it."""
    client = MlflowClient(uri)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.poll() is not None:
            raise AssertionError(f"the driver exited with {driver.returncode}:\n{driver.stdout.read()}")
        tags = client.get_run(run_id).data.tags
        found = [v for k, v in sorted(tags.items()) if k.startswith("towerflow.fault.") and text in v]
        if found:
            return found[0]
        time.sleep(0.5)
    driver.kill()
    raise TimeoutError(
        f"no fault tag saying {text!r} within {timeout:.0f} s: {driver.communicate()[0][-6000:]}"
    )
