"""A `python -m towerflow train` driver on the faults benchmark's local cluster, and what MLflow and
Ray's state API say of its run (benchmarks/faults_cluster.py's cases start, watch and kill these)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.5
STEP_TIMEOUT_S = 600.0  # from a driver's start to a step (actors import TensorFlow on a loaded machine)
RESIZE_TIMEOUT_S = 300.0
FINISH_TIMEOUT_S = 1200.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of Ray's log lines


class CaseError(Exception):
    """A case could not go on (a driver exited, a step or a resize never came): its message says why."""


def tracking_uri(folder: Path) -> str:
    return f"sqlite:///{folder / 'mlflow.db'}"


def mlflow_client(folder: Path):
    """A client of the run's store, its schema made before any driver writes to it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(folder))
    client.search_experiments()
    return client


@dataclass
class Driver:
    """A `python -m towerflow train` process (the leader of its process group), its output in a file."""

    process: subprocess.Popen
    output: Path
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    @property
    def wall_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def text(self, chars: int = 100_000) -> str:
        with contextlib.suppress(OSError):
            return ANSI.sub("", self.output.read_text(errors="replace"))[-chars:]
        return ""

    def check_running(self) -> None:
        if self.process.poll() is not None:
            self.ended = self.ended or time.monotonic()
            raise CaseError(f"the driver exited with {self.process.returncode}:\n{self.text(3000)}")

    def wait(self, timeout: float = FINISH_TIMEOUT_S) -> int:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise CaseError(f"the driver did not finish within {timeout:.0f} s:\n{self.text(3000)}") from None
        self.ended = self.ended or time.monotonic()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL its process group (a no-op once it has exited)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.ended = time.monotonic()

    def examples_per_sec(self) -> float | None:
        """The steady throughput of its summary line (`examples/sec=1,234`)."""
        found = re.findall(r"examples/sec=([\d,.]+)", self.text())
        return float(found[-1].replace(",", "")) if found else None


def start_driver(cluster, spec: Path, output: Path, *args: str, node: Any = None) -> Driver:
    """`towerflow train SPEC` on `cluster`; with `node`, its driver on that node (not the head's)."""
    from multinode_drivers import train_command  # tests/ (run_cluster_cases puts it on the path)

    with open(output, "ab") as out:
        process = subprocess.Popen(
            train_command(spec, *args, node=node),
            cwd=ROOT,
            env={**cluster.env(), "TF_CPP_MIN_LOG_LEVEL": "2"},
            stdin=subprocess.DEVNULL,
            stdout=out,  # a file, so that a chatty driver never blocks on a full pipe
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, to be killed as a lost head pod would be
        )
    return Driver(process, output)


def poll_store(fetch: Callable[[], Any]) -> Any:
    """`fetch()` of MLflow's SQLite store, None while the store is busy (a driver writes to it)."""
    from mlflow.exceptions import MlflowException

    try:
        return fetch()
    except MlflowException:
        return None


def latest_run(client, experiment: str):
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return runs[0] if runs else None


def wait_for_step(client, experiment: str, step: int, driver: Driver) -> tuple[str, float]:
    """(the run's id, the step MLflow shows) once MLflow shows `global_step` >= step."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        driver.check_running()
        run = poll_store(lambda: latest_run(client, experiment))
        seen = run.data.metrics.get("global_step", 0) if run else 0
        if seen >= step:
            return run.info.run_id, seen
        time.sleep(POLL_S)
    raise CaseError(f"MLflow showed no step {step} within {STEP_TIMEOUT_S:.0f} s:\n{driver.text(3000)}")


def wait_for_record(
    client, run_id: str, key: str, since_ms: int, driver: Driver, match: Callable[[Any], bool] | None = None
) -> Any:
    """The first record (an MLflow Metric: value, step, timestamp) of `key` from `since_ms` (epoch ms)
    on that `match`es, once MLflow holds it. Its own timestamp tells when: polling adds nothing."""
    deadline = time.monotonic() + RESIZE_TIMEOUT_S
    while time.monotonic() < deadline:
        history = poll_store(lambda: client.get_metric_history(run_id, key)) or []
        found = [m for m in history if m.timestamp >= since_ms and (match is None or match(m))]
        if found:
            return min(found, key=lambda m: m.timestamp)
        driver.check_running()
        time.sleep(POLL_S)
    history = sorted(
        (m.timestamp - since_ms, m.step, m.value) for m in client.get_metric_history(run_id, key)
    )
    raise CaseError(
        f"no such {key} record within {RESIZE_TIMEOUT_S:.0f} s; its records (ms after, step, value): {history}"
    )


def seconds_after(record: Any, since_ms: int) -> float:
    return (record.timestamp - since_ms) / 1000


def wait_for_checkpoint(client, run_id: str, driver: Driver) -> int:
    """The step of the run's newest complete checkpoint, once there is one: a driver killed before
    its first checkpoint leaves `--resume auto` nothing to go on from (it starts a new run)."""
    from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
    from towerflow.checkpoint.stores import latest_step

    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        step = poll_store(lambda: latest_step(MlflowCheckpointStore(client, run_id)))
        if step is not None:
            return step
        driver.check_running()
        time.sleep(POLL_S)
    raise CaseError(f"no checkpoint within {STEP_TIMEOUT_S:.0f} s")


def run_outcome(client, run_id: str, driver: Driver, max_steps: int) -> tuple[bool, Any, list[str]]:
    """(survived, the MLflow run, notes): exit 0, FINISHED, global_step == max_steps."""
    run = client.get_run(run_id)
    step = run.data.metrics.get("global_step")
    ok = driver.process.returncode == 0 and run.info.status == "FINISHED" and step == max_steps
    notes = [f"driver exit {driver.process.returncode}, run {run.info.status} at global_step {step}"]
    for key in ("workers_lost", "workers_replaced", "worker_recovery_s", "ps_rollbacks", "steps_redone"):
        if key in run.data.metrics:
            notes.append(f"{key}={run.data.metrics[key]:g}")
    notes += [f"{k}: {v}" for k, v in sorted(run.data.tags.items()) if k.startswith("towerflow.fault.")]
    if not ok:
        notes.append(f"the driver said: {driver.text(2000)!r}")
    return ok, run, notes


def now_ms() -> int:
    return int(time.time() * 1000)


def actors(cluster, class_name: str) -> list[dict]:
    reply = cluster.state_api("/api/v0/actors?limit=1000&detail=true")
    return [
        a
        for a in reply["data"]["result"]["result"]
        if a["class_name"] == class_name and a["state"] == "ALIVE"
    ]


def victim_node(cluster):
    """A live node that holds a worker but neither a shard nor the head's role; None if there is none."""
    shard_nodes = {a["node_id"] for a in actors(cluster, "ParameterShard")}
    worker_nodes = {a["node_id"] for a in actors(cluster, "TowerWorker")}
    for node in cluster.nodes[1:]:
        if not node.killed and node.node_id in worker_nodes - shard_nodes:
            return node
    return None
