"""`towerflow cluster up|status|down` as a user runs them: subprocesses, a real Ray head, PostgreSQL
and an authenticated MLflow server, and nothing of them left after `down`."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tracking_server import process_tree, still_running

from towerflow.local_cluster import auth_header, data_dir_for
from towerflow.local_cluster.processes import http_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
TOWERFLOW = str(Path(sys.executable).parent / "towerflow")
# Worker ports apart from the session's Ray (10002-19999), tests/cli/test_job_submit.py's head
# (23000-24999) and tests/multinode.py's nodes (25000-31999).
WORKER_PORTS = "21000-21099"


def _cluster(action: str, state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`towerflow cluster ACTION --state-dir STATE_DIR ARGS` from a shell with `_user_env()`."""
    command = [TOWERFLOW, "cluster", action, "--state-dir", str(state_dir), *args]
    return subprocess.run(command, env=_user_env(), capture_output=True, text=True, timeout=300)


def _user_env() -> dict[str, str]:
    """A shell with no cluster settings of its own: the cluster generates its secrets."""
    prefixes = ("RAY_", "MLFLOW_", "PG")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def test_up_status_down(tmp_path):
    state_dir = tmp_path / "my cluster"  # a space in its path: env.sh quotes the secrets' files
    # What a crashed head leaves: its record, nothing running, its session's folder
    crashed = tmp_path / "tfcluster-crashed"
    crashed.mkdir()
    state_dir.mkdir()
    record = {"state_dir": str(state_dir), "postgres_data_dir": str(data_dir_for(state_dir))}
    (state_dir / "cluster.json").write_text(json.dumps({**record, "ray_temp_dir": str(crashed)}))
    try:
        up = _cluster("up", state_dir, "--num-cpus", "2", "--worker-ports", WORKER_PORTS)
        assert up.returncode == 0, up.stderr
        assert not crashed.exists()
        state = json.loads((state_dir / "cluster.json").read_text())
        servers = ("ray_process", "mlflow_process", "postgres_process")
        processes = [p for key in servers for p in process_tree(state[key]["pid"])]
        token = (state_dir / "ray_auth_token").read_text().strip()
        password = (state_dir / "mlflow_password").read_text().strip()

        # What a user is told to source: addresses, and secrets read from their 0600 files.
        env_sh = (state_dir / "env.sh").read_text()
        assert f"source {shlex.quote(str(state_dir / 'env.sh'))}" in up.stdout
        assert f"export RAY_ADDRESS={state['ray_address']}" in env_sh
        assert f"export MLFLOW_TRACKING_URI={state['tracking_uri']}" in env_sh
        assert token not in env_sh + up.stdout + up.stderr and password not in env_sh + up.stdout
        for secret in ("ray_auth_token", "mlflow_password", "postgres_password", "env.sh", "basic_auth.ini"):
            assert (state_dir / secret).stat().st_mode & 0o777 == 0o600, secret

        # The head's job server wants the token; the tracking server its admin's password.
        version = f"{state['ray_address']}/api/version"
        assert http_status(version, {"Authorization": f"Bearer {token}"}) == 200
        assert http_status(version) == 401
        experiments = f"{state['tracking_uri']}/api/2.0/mlflow/experiments/search?max_results=1"
        assert http_status(experiments) == 401
        assert http_status(experiments, auth_header("admin", password)) == 200
        assert state["ray_address"].startswith("http://127.0.0.1:")
        assert state["tracking_uri"].startswith("http://127.0.0.1:")

        # A job submitted from a shell that sourced env.sh logs to the tracking server: the head
        # hands its jobs the server's address and credentials.
        ray = Path(sys.executable).parent / "ray"
        job = "import mlflow; print('runs seen:', len(mlflow.MlflowClient().search_runs(['0'])))"
        shell = f"source {shlex.quote(str(state_dir / 'env.sh'))} && {ray} job submit -- python -c {shlex.quote(job)}"
        submitted = subprocess.run(
            ["bash", "-c", shell], env=_user_env(), capture_output=True, text=True, timeout=180
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        assert "runs seen: 0" in submitted.stdout

        status = _cluster("status", state_dir)
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count(" running ") == 3, status.stdout

        again = _cluster("up", state_dir)
        assert again.returncode == 2 and "already runs" in again.stderr

        down = _cluster("down", state_dir)
        assert down.returncode == 0, down.stderr
        assert "stopped ray, mlflow, postgres" in down.stdout
        assert not still_running(processes)
        assert not Path(state["ray_temp_dir"]).exists()

        assert "no local cluster was running" in _cluster("down", state_dir).stdout  # idempotent
        assert _cluster("status", state_dir).returncode == 3
    finally:
        _cluster("down", state_dir)
        shutil.rmtree(data_dir_for(state_dir), ignore_errors=True)


def test_a_short_mlflow_password_is_refused_before_anything_starts(tmp_path):
    command = [TOWERFLOW, "cluster", "up", "--state-dir", str(tmp_path / "cluster")]
    env = {**_user_env(), "MLFLOW_TRACKING_PASSWORD": "short"}
    up = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert up.returncode == 2
    assert "MLFLOW_TRACKING_PASSWORD is shorter than 12 characters" in up.stderr
    assert not (tmp_path / "cluster" / "cluster.json").exists()


def test_an_up_killed_while_it_waits_for_the_tracking_server_leaves_nothing_down_cannot_stop(tmp_path):
    """`up` SIGKILLed (a CI timeout, a closed terminal's SIGHUP alike) once the tracking server
    started and before it answered: cluster.json names the server already, so `down` stops it
    with the head and PostgreSQL, and its port is free for the next `up`."""
    import signal
    import time

    state_dir = tmp_path / "cluster"
    command = [TOWERFLOW, "cluster", "up", "--state-dir", str(state_dir), "--num-cpus", "1"]
    up = subprocess.Popen(
        [*command, "--worker-ports", WORKER_PORTS],
        env=_user_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        state: dict = {}
        while not state.get("mlflow_process") and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            with contextlib.suppress(OSError, ValueError):  # not written yet, or half written
                state = json.loads((state_dir / "cluster.json").read_text())
        assert state.get("mlflow_process") and state.get("tracking_uri") is None, state
        up.send_signal(signal.SIGKILL)
        up.wait()
        processes = [p for key in ("mlflow_process", "ray_process") for p in process_tree(state[key]["pid"])]
        down = _cluster("down", state_dir)
        assert down.returncode == 0 and "mlflow" in down.stdout, down.stdout + down.stderr
        assert not still_running(processes)
    finally:
        up.kill()
        _cluster("down", state_dir)
        shutil.rmtree(data_dir_for(state_dir), ignore_errors=True)
