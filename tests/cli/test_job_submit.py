"""`ray job submit`, as the README tells a user to run it, against a real Ray head of its own.

The head runs as `ray start --head --block` with token authentication on and every server on
127.0.0.1; the job ships the repository as its working directory and runs `python -m towerflow train`
there. This is the only test with a second Ray: jobs need the dashboard's job server, which the
session's Ray does without.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import numpy as np
import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient
from support import free_ports, mlflow_uri

from towerflow.checkpoint.stores import MlflowCheckpointStore
from towerflow.data.synth import synth_tabular
from towerflow.runtime.cluster import SINGLE_MACHINE_SWITCH

pytestmark = pytest.mark.timeout(300)
RAY_CLI = str(Path(sys.executable).parent / "ray")  # the `ray` command of this environment


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """(dashboard address, environment of a user who holds the cluster's token) of a fresh head."""
    gcs, dashboard, agent, agent_grpc, client = free_ports(5)
    workers = (
        23000 + secrets.randbelow(20) * 100
    )  # a worker port range of its own, apart from the session's Ray
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),  # `python` is this one
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # stop at once, not after draining for up to 30 s
        **{SINGLE_MACHINE_SWITCH: "0"},  # every server on 127.0.0.1
    )
    # Ray's socket paths live under its temp dir: keep it short (Unix sockets allow 107 bytes).
    temp_dir = tempfile.mkdtemp(prefix="tfjob", dir="/tmp")
    head = subprocess.Popen(
        [
            RAY_CLI,
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--ray-client-server-port={client}",
            f"--min-worker-port={workers}",
            f"--max-worker-port={workers + 99}",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_job_server(address, env["RAY_AUTH_TOKEN"], head)
        yield address, env
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops everything it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _wait_for_job_server(address: str, token: str, head: subprocess.Popen, timeout: float = 120) -> None:
    request = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}: {head.stderr.read()}")
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the job server at {address} did not answer within {timeout:.0f} s")


def _submit(address: str, env: dict, runtime_env: str, *train_args: str) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir . -- python -m towerflow train ...`, from the repository root."""
    return subprocess.run(
        [
            RAY_CLI,
            "job",
            "submit",
            f"--address={address}",
            "--working-dir=.",
            f"--runtime-env-json={runtime_env}",
            "--",
            "python",
            "-m",
            "towerflow",
            "train",
            *train_args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _tabular_job(tmp_path: Path, *settings: str) -> tuple[str, list[str]]:
    """A small CSV data set and a store both this test and the job can reach; the --set values that
    point the tabular pipeline at them (one worker, batches of 64), then `settings`."""
    synth_tabular(tmp_path / "data", shards=2, examples=1_000, eval_examples=100, seed=2, fmt="csv")
    data = [
        f"data.train.paths={tmp_path}/data/train-*.csv",
        f"data.eval.paths={tmp_path}/data/eval-*.csv",
        "data.batch_size=64",
        "cluster.workers=1",
    ]
    return f"sqlite:///{tmp_path / 'mlflow.db'}", data + list(settings)


def test_a_submitted_job_trains_tracks_and_registers_its_model(ray_head, tmp_path):
    address, env = ray_head
    store, settings = _tabular_job(tmp_path, "training.max_steps=6")
    out = _submit(
        address,
        env,
        f'{{"env_vars": {{"MLFLOW_TRACKING_URI": "{store}"}}}}',
        "pipelines/tabular_csv.yaml",
        *[a for s in settings for a in ("--set", s)],
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs
    summary = [line for line in logs.splitlines() if line.startswith("towerflow: run ")]
    assert len(summary) == 1 and "finished steps=6" in summary[0], logs
    assert "towerflow: warning" not in logs  # the store is the one the job was given
    # The job's log carries every actor's: none has TensorFlow's early C++ lines (tf_import.py),
    # nor Ray Data's execution plan.
    assert "absl::InitializeLog" not in logs and "I0000 00:00" not in logs, logs
    assert "Execution plan of Dataset" not in logs, logs
    run_id = summary[0].split()[2]

    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == 6
    assert run.data.tags["towerflow.registered_model"] == "models:/tabular-mlp@champion"
    with mlflow_uri(store):
        served = mlflow.pyfunc.load_model("models:/tabular-mlp@champion")
        logits = served.predict({"x": np.zeros((3, 30), np.float32), "category": np.array([0, 1, 2])})
    assert logits.shape == (3, 2) and np.isfinite(logits).all()


def test_a_submitted_job_with_missing_data_fails_with_the_pattern_named(ray_head, tmp_path):
    # No MLFLOW_TRACKING_URI: the job is warned that its default store would be lost with Ray's
    # working directory of the job.
    address, env = ray_head
    missing = f"{tmp_path}/nowhere/train-*.csv"
    settings = [f"data.train.paths={missing}", f"data.eval.paths={missing}"]
    out = _submit(
        address, env, "{}", "pipelines/tabular_csv.yaml", *[a for s in settings for a in ("--set", s)]
    )
    logs = out.stdout + out.stderr
    assert out.returncode != 0, logs
    assert f"paths: '{missing}' matches no files" in logs, logs
    assert "towerflow: warning: this Ray job would keep its MLflow runs in" in logs
    assert "Traceback" not in logs


def test_ray_job_stop_ends_the_run_killed_with_a_checkpoint_of_its_last_step(ray_head, tmp_path):
    # `ray job stop` sends SIGTERM and, 3 s later (RAY_JOB_STOP_WAIT_TIME_S), SIGKILL. The run
    # stops after its steps in flight and saves them; its periodic checkpoints are far apart.
    address, env = ray_head
    store, settings = _tabular_job(
        tmp_path,
        "data.epochs=null",
        "training.max_steps=1000000",
        "supervision.checkpoint.every_steps=100000",
        "export.saved_model=false",
    )
    job_id = f"towerflow-stop-{secrets.token_hex(4)}"
    submitted = subprocess.run(
        [RAY_CLI, "job", "submit", f"--address={address}", f"--submission-id={job_id}", "--no-wait"]
        + ["--working-dir=.", f'--runtime-env-json={{"env_vars": {{"MLFLOW_TRACKING_URI": "{store}"}}}}']
        + ["--", "python", "-m", "towerflow", "train", "pipelines/tabular_csv.yaml"]
        + [a for s in settings for a in ("--set", s)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    def logs() -> str:
        out = subprocess.run(
            [RAY_CLI, "job", "logs", f"--address={address}", job_id], env=env, capture_output=True, text=True
        )
        return out.stdout

    deadline = time.monotonic() + 180
    while not any(line.startswith("step ") for line in logs().splitlines()):  # training, and logged
        assert time.monotonic() < deadline, logs()
        time.sleep(1)
    stopped = subprocess.run(
        [RAY_CLI, "job", "stop", f"--address={address}", job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    text = logs()
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("tabular").experiment_id])
    assert run.info.status == "KILLED", text
    final_step = int(run.data.metrics["global_step"])
    assert [step for step, _ in MlflowCheckpointStore(client, run.info.run_id).list()] == [final_step], text
    assert f"saved a checkpoint of step {final_step} before stopping" in text, text
    assert f"--resume {run.info.run_id}" in text, text


def test_towerflow_submit_sends_the_job_follows_it_and_names_its_run(ray_head, tmp_path):
    address, env = ray_head
    store, settings = _tabular_job(tmp_path, "training.max_steps=6", "export.saved_model=false")
    out = subprocess.run(
        [sys.executable, "-m", "towerflow", "submit", "pipelines/tabular_csv.yaml", "--address", address]
        + ["--set", *settings],
        cwd=REPO,
        env={**env, "MLFLOW_TRACKING_URI": store},  # what the job is given to track to
        capture_output=True,
        text=True,
        timeout=240,
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs
    job_id = logs.split("towerflow: submitted job ", 1)[1].split()[0]
    assert f"ray job logs -f --address {address} {job_id}" in logs
    assert f"towerflow: job {job_id} SUCCEEDED" in logs
    run_id = logs.split("towerflow: the job tracks MLflow run ", 1)[1].split()[0]
    run = MlflowClient(store).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == 6


def test_towerflow_submit_refuses_a_bad_spec_before_sending_anything(ray_head):
    address, env = ray_head
    out = subprocess.run(
        [sys.executable, "-m", "towerflow", "submit", "pipelines/tabular_csv.yaml", "--address", address]
        + ["--set", "training.mode=hogwild"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "training.mode" in out.stderr and "submitted job" not in out.stdout
