"""The command line as a user runs it: real subprocesses, exit codes, messages, the MLflow store."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import yaml
from conftest import REPO
from mlflow.tracking import MlflowClient
from support import ONE_OF_EACH, blob_spec, sqlite_store, takes_ctrl_c, unstamped

from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.runtime.cluster import AUTH_MODE, SINGLE_MACHINE_SWITCH, machine_cores
from towerflow.runtime.worker_cpus import auto_worker_cpus
from towerflow.spec import validate_spec

# `python -m towerflow` puts the working directory on sys.path; the console script (what `make
# example` runs) does not, so both are exercised.
_CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "towerflow")


def _run(args, *, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "towerflow", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cluster_env(ray_cluster, tmp_path):
    """Point the CLI at this session's Ray (token auth on) and a fresh MLflow store."""
    return {
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
        "MLFLOW_TRACKING_URI": sqlite_store(tmp_path),
    }


def test_no_command_prints_help():
    out = _run([])
    assert out.returncode == 2 and "train" in out.stdout


def test_console_script_is_installed():
    out = subprocess.run(
        ["towerflow", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"},
    )
    assert out.returncode == 0 and "train" in out.stdout


def test_missing_spec_is_a_clear_error():
    out = _run(["train", "does/not/exist.yaml"])
    assert out.returncode == 2
    assert "does/not/exist.yaml: no such spec file" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_command_runs_its_exit_handlers_and_keeps_its_exit_code():
    """`run` ends the process itself after `main` (no interpreter teardown): what was registered to
    run at exit still runs, and what it printed still comes out."""
    script = (
        "import atexit, sys; from towerflow.cli.main import run; "
        "atexit.register(print, 'an exit handler ran', end=''); "
        "sys.argv = ['towerflow', 'train', 'does/not/exist.yaml']; run()"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "an exit handler ran", out
    assert "no such spec file" in out.stderr


def test_invalid_spec_names_the_key(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**blob_spec(tmp_path), "trainig": {"mode": "sync"}}))
    # One --set may carry several overrides, and --set may repeat: all of them reach validation.
    out = _run(
        ["train", str(path), "--set", "training.mode=sometimes", "data.batch_size=0", "--set", "cluster.ps=0"]
    )
    assert out.returncode == 2
    assert "trainig: unknown key" in out.stderr and "training.mode" in out.stderr
    assert "data.batch_size" in out.stderr and "cluster.ps" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_spec_given_after_set_is_named_not_swallowed():
    out = _run(["train", "--set", "training.max_steps=3", "pipelines/mnist_sync.yaml"])
    assert out.returncode == 2
    assert "--set: expected KEY=VALUE, got 'pipelines/mnist_sync.yaml'" in out.stderr


def test_missing_data_fails_the_run_with_the_pattern_named(cluster_env, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(blob_spec(tmp_path / "nowhere")))
    out = _run(["train", str(path), "--no-progress"], env=cluster_env)
    assert out.returncode == 2, out.stderr
    assert "nowhere/train-*" in out.stderr and "matches no files" in out.stderr
    assert "Traceback" not in out.stderr
    client = MlflowClient(cluster_env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("blobs-test").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert "matches no files" in runs[0].data.tags["towerflow.error"]


def test_the_driver_imports_no_tensorflow_for_a_run_that_needs_none_there(cluster_env, blob_data, tmp_path):
    # Workers and shards compute and write their checkpoint parts; a driver with nothing of its own
    # to do in TensorFlow (no model part to checkpoint, no export, no user hooks) does not pay its
    # import, seconds of CPU before any actor starts. models.mlp imports Keras at its top: its
    # parameters are checked from its source.
    path = tmp_path / "job.yaml"
    spec = blob_spec(blob_data, cluster=ONE_OF_EACH, training={"max_steps": 4})
    path.write_text(yaml.safe_dump({**spec, "supervision": {"checkpoint": {"every_steps": 2}}}))
    # driver_restarts 0: this process is the driver (on a cluster the command would supervise one).
    script = (
        "import sys; from towerflow.cli.main import main; "
        "code = main(['train', sys.argv[1], '--no-progress', '--set', 'training.failure.driver_restarts=0']); "
        "print('imported:', sorted({m.partition('.')[0] for m in sys.modules} & {'tensorflow', 'keras'})); "
        "sys.exit(code)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        cwd=REPO,
        env={**os.environ, **cluster_env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (summary,) = [line for line in unstamped(out.stdout) if line.startswith("towerflow: run ")]
    assert "finished steps=4" in summary, out.stdout
    store = MlflowCheckpointStore(MlflowClient(cluster_env["MLFLOW_TRACKING_URI"]), summary.split()[2])
    assert [step for step, _ in store.list()] == [2, 4]
    assert "imported: []" in out.stdout.splitlines(), out.stdout


def test_ctrl_c_twice_ends_the_run_killed_and_says_how_to_resume(cluster_env, blob_data, tmp_path):
    # Ctrl-C as a user at a terminal presses it (SIGTERM, as `ray job stop` and Kubernetes send it,
    # is test_job_submit.py's job stop). An interrupt raised inside an MLflow write left the SQLite
    # store locked and the run RUNNING. The run is long and its data repeats (data.epochs: null):
    # its 250,000 file reads once made a Ray Data block each, and the job waited minutes to start.
    # The second Ctrl-C lands in a user hook's slow end (user hooks end first): it stops that, no
    # checkpoint is taken, the run is still marked KILLED.
    path = tmp_path / "job.yaml"
    spec = blob_spec(
        blob_data,
        data={"epochs": None},
        training={"max_steps": 1_000_000},
        supervision={"checkpoint": {"every_steps": 100_000}, "hooks": [{"ref": "sample_hooks:SlowEndHook"}]},
    )
    path.write_text(yaml.safe_dump(spec))
    command = [sys.executable, "-m", "towerflow", "train", str(path), "--set", "training.max_steps=999999"]
    env = {**os.environ, **cluster_env, "PYTHONPATH": str(REPO / "tests")}  # tests/ for the hook only
    cli = subprocess.Popen(
        command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=takes_ctrl_c
    )
    watchdog = threading.Timer(180, cli.kill)  # a hang fails the test instead of holding the suite
    watchdog.start()
    try:
        before = []
        for line in cli.stderr:  # the first progress line: the actors are up and training
            before.append(line)
            if re.search(r"^\S+ \S+ step \d", line):  # after the time: a pipe is read later
                break
        time.sleep(3)
        cli.send_signal(signal.SIGINT)
        for line in cli.stderr:
            before.append(line)
            if "SlowEndHook ending" in line:
                break
        cli.send_signal(signal.SIGINT)
        after = cli.stderr.read()
        exit_code = cli.wait(timeout=60)
    finally:
        watchdog.cancel()
    everything = "".join(before) + after
    assert exit_code == 130, everything
    client = MlflowClient(cluster_env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name("blobs-test").experiment_id])
    assert run.info.status == "KILLED"
    assert int(run.data.metrics["global_step"]) > 0
    checkpoints = [step for step, _ in MlflowCheckpointStore(client, run.info.run_id).list()]
    assert checkpoints == [] and "hook SlowEndHook.end interrupted" in after, everything
    assert (
        f"python -m towerflow train {path} --set training.max_steps=999999 --resume {run.info.run_id}"
        in after
    )
    ours = [line for line in unstamped(after) if line.startswith("towerflow")]  # not Ray's forwarded logs
    assert ours[-1] == "towerflow: interrupted", after
    assert "Traceback" not in everything, everything


def test_a_driver_killed_as_its_run_starts_is_started_again_and_starts_the_same_run_over(
    cluster_env, blob_data, tmp_path
):
    """On a cluster the command supervises its driver (`driver_restarts: auto`). Killed as soon as
    it names its MLflow run, the driver has neither a checkpoint nor live shards to resume from: the
    driver started again trains the same run from step 0 (it used to fail, `no complete checkpoint
    there to resume from`), and the run's params and fault tag say what happened."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(blob_spec(blob_data, cluster=ONE_OF_EACH, training={"max_steps": 4})))
    command = [sys.executable, "-m", "towerflow", "train", str(path), "--no-progress"]
    cli = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, **cluster_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(240, cli.kill)  # a hang fails the test instead of holding the suite
    watchdog.start()
    try:
        printed = []
        for line in cli.stdout:
            printed.append(line)
            if unstamped(line)[0].startswith("towerflow: MLflow run "):
                (driver,) = psutil.Process(cli.pid).children()
                driver.send_signal(signal.SIGKILL)
                break
        printed.append(cli.stdout.read())
        errors = cli.stderr.read()
        exit_code = cli.wait(timeout=60)
    finally:
        watchdog.cancel()
    assert exit_code == 0, errors
    client = MlflowClient(cluster_env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name("blobs-test").experiment_id])
    assert f"starting it again to resume run {run.info.run_id}" in errors
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == 4, "".join(printed)
    assert [step for step, _ in MlflowCheckpointStore(client, run.info.run_id).list()] == [4]
    (fault,) = [value for key, value in run.data.tags.items() if key.startswith("towerflow.fault.")]
    assert "a new driver started it over from step 0" in fault, fault
    assert "model.trainable_variables" in run.data.params  # the killed driver had logged none


def test_train_end_to_end_on_an_embedded_ray(blob_data, tmp_path):
    # As `make example` runs it: the console script, no RAY_ADDRESS (so the command starts its own Ray,
    # which must not listen on the network), and an export, for which the driver itself imports
    # models.mlp from the working directory. A hook records every address Ray's processes listen on.
    record = tmp_path / "listening.json"
    hook = {"ref": "sample_hooks:ListeningAddressesHook", "params": {"out": str(record)}}
    # cpus_per_worker: auto (the default) resolved on the machine the command starts Ray on
    spec = blob_spec(
        blob_data, cluster={**ONE_OF_EACH, "cpus_per_worker": "auto"}, supervision={"hooks": [hook]}
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    store = sqlite_store(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", SINGLE_MACHINE_SWITCH, AUTH_MODE)}
    env |= {"PYTHONPATH": str(REPO / "tests"), "MLFLOW_TRACKING_URI": store}  # tests/ for the hook only
    settings = ["training.max_steps=6", "training.mode=async", "export.saved_model=true"]
    out = subprocess.run(
        [_CONSOLE_SCRIPT, "train", str(path), *[a for s in settings for a in ("--set", s)]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr

    summary = [line for line in unstamped(out.stdout) if line.startswith("towerflow: run ")]
    assert len(summary) == 1 and "finished steps=6" in summary[0] and "examples/sec=" in summary[0]
    assert "for this process's next run" not in out.stdout + out.stderr  # one run: nothing kept for a next
    run_id = summary[0].split()[2]
    run = MlflowClient(store).get_run(run_id)
    # `towerflow ui` over the store MLFLOW_TRACKING_URI names (so no --store), and the run's page
    (browse,) = [line for line in out.stdout.splitlines() if "browse it with: " in line]
    command = browse.split("browse it with: ")[1].split("  (then open ")[0].split()
    assert command[1:] == ["ui"] and shutil.which(command[0], path=env["PATH"]), browse  # runs as printed
    page = f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    assert browse.endswith(f"(then open {page})"), browse
    assert run.info.status == "FINISHED"
    assert run.data.params["training.mode"] == "async" and run.data.params["cluster.workers"] == "1"
    cpus = auto_worker_cpus(validate_spec(spec).cluster, machine_cores())
    assert run.data.params["cluster.cpus_per_worker"] == str(float(cpus))
    assert f"cluster.cpus_per_worker: auto -> {cpus} (this machine's {machine_cores()} cores" in out.stderr
    assert run.data.tags["mode"] == "async"
    assert {"loss", "global_step", "examples_per_sec"} <= set(run.data.metrics)
    assert run.data.metrics["global_step"] == 6
    assert run.data.tags["towerflow.model_uri"].startswith("models:/")

    recorded = json.loads(record.read_text())
    assert recorded["token_auth"] and recorded["gcs_auth_mode"] == ["token"], recorded
    assert "to opt out" not in out.stderr  # chosen, so Ray does not suggest it
    listening = recorded["listening"]
    assert {"gcs_server", "raylet"} <= {entry["process"] for entry in listening}, listening
    exposed = [e for e in listening if e["address"] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert exposed == [], f"listening beyond loopback: {exposed}"
    assert "warning: the embedded Ray listens" not in out.stderr
