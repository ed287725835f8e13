"""`ray job submit` and `towerflow submit`, as the README tells a user to run them, on the cluster
path: a real multi-node Ray cluster (tests/multinode.py: three nodes, each its own raylet and object
store, token authentication on) and a real tracking server (tests/tracking_server.py: PostgreSQL
backend store, basic-auth, artifacts proxied by the server, so no node needs another's disk).

The nodes hold the tracking server's credentials in their environment, as KubeRay pods get them
from a Secret; each job is given the tracking URI. Jobs ship the repository as their working
directory and run `python -m towerflow train` there.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient
from multinode import RAY_CLI, LocalCluster
from support import sqlite_store, unstamped
from tracking_server import tracking_server_fixture  # noqa: F401

from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.data.synth import synth_mnist, synth_tabular

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_head(tracking_server):
    """(dashboard address, environment of a user who holds the cluster's token) of a three-node
    cluster whose nodes hold the tracking server's credentials."""
    credentials = {k: v for k, v in tracking_server.env.items() if k != "MLFLOW_TRACKING_URI"}
    with LocalCluster(head_cpus=2, node_cpus=(2, 2), node_env=credentials) as cluster:
        yield cluster.dashboard_url, cluster.env()


@pytest.fixture(scope="module")
def mnist_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mnist")
    synth_mnist(str(folder), shards=2, examples=512, eval_examples=128, seed=0)
    return folder


def _mnist_settings(data: Path, experiment: str) -> list[str]:
    """The mnist pipeline, small: 1 worker and 2 shards, 6 steps, checkpoints at 3 and 6, one
    evaluation, export and register."""
    return [
        "cluster.workers=1",
        "training.replicas_to_aggregate=1",
        "training.total_num_replicas=1",
        f"data.train.paths={data}/train-*",
        f"data.eval.paths={data}/eval-*",
        "data.batch_size=32",
        "training.max_steps=6",
        "supervision.checkpoint.every_steps=3",
        "supervision.eval.every_steps=6",
        "supervision.eval.max_batches=2",
        "supervision.log_every_steps=1",
        f"tracking.experiment={experiment}",
    ]


def _check_tracked_on_the_server(tracking_server, run_id: str, monkeypatch, full: bool = True) -> None:
    """The run, its metrics and checkpoints (one part per shard) on the server; artifacts written
    through it into its artifacts destination."""
    for key, value in tracking_server.env.items():
        monkeypatch.setenv(key, value)
    client = MlflowClient(tracking_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == 6
    assert "loss" in run.data.metrics and ("eval_accuracy" in run.data.metrics) == full
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri
    store = MlflowCheckpointStore(client, run_id)
    assert [step for step, _ in store.list()] == [3, 6]
    assert [part.name for part in store.open(6).parts] == ["shard-00000", "shard-00001"]
    stored = list(
        Path(tracking_server.server.artifacts_dir).rglob(f"{run_id}/artifacts/checkpoints/*/shard-*/*")
    )
    assert stored, "the checkpoint parts did not reach the server's artifacts destination"
    if full:  # evaluated, exported and registered
        assert run.data.tags["towerflow.registered_model"] == "models:/mnist-lenet@champion"


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
    return sqlite_store(tmp_path), data + list(settings)


def test_ray_job_submit_trains_on_the_cluster_tracks_to_the_server_and_registers_its_model(
    ray_head, tracking_server, mnist_data, tmp_path, monkeypatch
):
    address, env = ray_head
    settings = _mnist_settings(mnist_data, "cluster-path")
    out = _submit(
        address,
        env,
        json.dumps({"env_vars": {"MLFLOW_TRACKING_URI": tracking_server.uri}}),
        "pipelines/mnist_sync.yaml",
        *[a for s in settings for a in ("--set", s)],
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs  # the CLI exits 0 once the job SUCCEEDED
    assert re.search(r"Job '[^']+' succeeded", logs), logs
    summary = [line for line in unstamped(logs) if line.startswith("towerflow: run ")]
    assert len(summary) == 1 and "finished steps=6" in summary[0], logs
    assert "would keep its MLflow runs in" not in logs and "goes through the driver" not in logs, logs
    # The job's log carries every actor's: none has TensorFlow's early C++ lines (tf_import.py),
    # nor Ray Data's execution plan.
    assert "absl::InitializeLog" not in logs and "I0000 00:00" not in logs, logs
    assert "Execution plan of Dataset" not in logs, logs
    assert "tqdm is not installed" not in logs and "progress UI" not in logs, logs  # nor its progress bars
    # cpus_per_worker: auto read the cluster joined: three 2-CPU nodes hold one 1-CPU worker each
    # beside a shard and Ray Data's CPU
    assert "cluster.cpus_per_worker: auto -> 1 on the Ray cluster joined (3 node(s): 2, 2, 2 CPUs" in logs
    run_id = summary[0].split()[2]
    # the run's page on the tracking server, which serves its own UI
    assert re.search(
        rf"towerflow: open it at {re.escape(tracking_server.uri)}/#/experiments/\d+/runs/{run_id}", logs
    )
    _check_tracked_on_the_server(tracking_server, run_id, monkeypatch)

    # Served from the registry by a process that has only the server (not the job's directory).
    predict = (
        "import mlflow, numpy as np\n"
        "model = mlflow.pyfunc.load_model('models:/mnist-lenet@champion')\n"
        "out = model.predict(np.zeros((3, 28, 28, 1), np.float32))\n"
        "print(np.asarray(out).shape, bool(np.isfinite(out).all()))\n"
    )
    served = subprocess.run(
        [sys.executable, "-c", predict],
        cwd=tmp_path,
        env={"PATH": env["PATH"], "HOME": str(tmp_path), **tracking_server.env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert served.returncode == 0, served.stderr[-4000:]
    assert served.stdout.strip().splitlines()[-1] == "(3, 10) True", served.stdout


def test_towerflow_submit_trains_on_the_cluster_and_tracks_to_the_server(
    ray_head, tracking_server, mnist_data, monkeypatch
):
    address, env = ray_head
    out = subprocess.run(
        [sys.executable, "-m", "towerflow", "submit", "pipelines/mnist_sync.yaml", "--address", address]
        + [
            "--tracking-uri",
            tracking_server.uri,
            "--set",
            *_mnist_settings(mnist_data, "cluster-path-submit"),
            # the registered model and its evaluation are the ray job submit test's: this one is quicker
            "data.eval=null",
            "supervision.eval=null",
            "export.saved_model=false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs
    job_id = logs.split("towerflow: submitted job ", 1)[1].split()[0]
    assert f"ray job logs -f --address {address} {job_id}" in logs
    assert f"towerflow: job {job_id} SUCCEEDED" in logs
    # The job's log shows the run's progress (a line at the first step, then every 10 s).
    assert re.search(r"^\S+ \S+ step 1/6 loss \d", logs, re.M), logs
    run_id = logs.split("towerflow: the job tracks MLflow run ", 1)[1].split()[0]
    _check_tracked_on_the_server(tracking_server, run_id, monkeypatch, full=False)


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

    # Training, as the run's metrics show (each `ray job logs` would start a Python process).
    client = MlflowClient(store)
    deadline = time.monotonic() + 180
    while not _global_step_of_the_only_run(client, "tabular"):
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
    (run,) = client.search_runs([client.get_experiment_by_name("tabular").experiment_id])
    assert run.info.status == "KILLED", text
    final_step = int(run.data.metrics["global_step"])
    assert [step for step, _ in MlflowCheckpointStore(client, run.info.run_id).list()] == [final_step], text
    assert f"saved a checkpoint of step {final_step} before stopping" in text, text
    assert f"--resume {run.info.run_id}" in text, text
    ours = [line for line in unstamped(text) if line.startswith("towerflow")]  # not Ray's lines
    assert ours[-1] == "towerflow: terminated (SIGTERM)", text
    # Ray's own SIGTERM handler exited after a C++ stack dump and left the run FAILED.
    assert "SIGTERM received" not in text and "Traceback" not in text, text


def _global_step_of_the_only_run(client: MlflowClient, experiment: str) -> float:
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found is not None else []
    return runs[0].data.metrics.get("global_step", 0.0) if runs else 0.0


def test_towerflow_submit_refuses_a_bad_spec_before_sending_anything(ray_head):
    address, env = ray_head
    out = _refused_submit(address, env, "--set", "training.mode=hogwild")
    assert "training.mode" in out.stderr and "submitted job" not in out.stdout


def test_towerflow_submit_with_a_wrong_ray_token_is_told_so(ray_head):
    """The job server refuses a shell without the cluster's token: one paragraph that says which
    variables to set, exit 2; not a traceback."""
    address, env = ray_head
    out = _refused_submit(address, {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})
    assert "refused this shell's Ray token" in out.stderr and "RAY_AUTH_TOKEN" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "submitted job" not in out.stdout


def _refused_submit(address: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    """`towerflow submit` of the tabular job, which must exit 2 (a user's error)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "towerflow",
            "submit",
            "pipelines/tabular_csv.yaml",
            "--address",
            address,
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    return out
