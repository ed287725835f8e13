"""`towerflow cluster up|down|status`: a Ray head, PostgreSQL and an authenticated MLflow server on
127.0.0.1, to try the cluster path on one machine.

Everything lives in a state directory (default ~/.towerflow/cluster, or TOWERFLOW_CLUSTER_DIR):
`cluster.json` (pids, ports, addresses; rewritten after each server starts, so that `down` finds
whatever an interrupted `up` left), `env.sh` (what a shell exports to use the cluster), the
generated secrets (0600), the servers' logs, the proxied artifacts and the database (kept by
`down`, so the next `up` has the runs of the last). As root the database lives under /var/tmp
(see postgres.data_dir_for).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

from towerflow.errors import TowerflowError
from towerflow.local_cluster import credentials
from towerflow.local_cluster.head import RayHead, launch_head, stop_head, wait_for_head
from towerflow.local_cluster.postgres import data_dir_for, log_path_of, start_postgres, stop_postgres
from towerflow.local_cluster.processes import ProcessRef, free_port, stop_tree
from towerflow.local_cluster.tracking_server import MLFLOW_LOG, start_tracking_server

STATE_FILE = "cluster.json"
ENV_FILE = "env.sh"
RAY_LOG = "ray-head.log"
_log = logging.getLogger(__name__)


@dataclass
class ClusterState:
    """What `up` started, as `cluster.json` records it; a server not (yet) started has None."""

    state_dir: Path
    postgres_data_dir: Path
    postgres_port: int | None = None
    postgres_process: ProcessRef | None = None
    tracking_uri: str | None = None
    mlflow_username: str | None = None
    mlflow_process: ProcessRef | None = None
    artifacts_dir: Path | None = None
    ray_address: str | None = None  # the dashboard's job server, http://127.0.0.1:PORT
    ray_gcs_address: str | None = None
    ray_temp_dir: Path | None = None
    ray_process: ProcessRef | None = None

    @property
    def env_file(self) -> Path:
        return self.state_dir / ENV_FILE

    def logs(self) -> dict[str, Path]:
        """Each server's log file."""
        return {
            "ray": self.state_dir / RAY_LOG,
            "mlflow": self.state_dir / MLFLOW_LOG,
            "postgres": log_path_of(self.postgres_data_dir),
        }

    def running(self) -> dict[str, bool]:
        """Each server, and whether it runs now."""
        return {
            "ray": bool(self.ray_process and self.ray_process.is_running()),
            "mlflow": bool(self.mlflow_process and self.mlflow_process.is_running()),
            "postgres": bool(self.postgres_process and self.postgres_process.is_running()),
        }

    def save(self) -> None:
        data = {}
        for item in fields(self):
            value = getattr(self, item.name)
            data[item.name] = asdict(value) if isinstance(value, ProcessRef) else _plain(value)
        (self.state_dir / STATE_FILE).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState | None:
        path = Path(state_dir) / STATE_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        for name, value in data.items():
            if name.endswith("_process") and value:
                data[name] = ProcessRef(**value)
            elif name.endswith("_dir") and value:
                data[name] = Path(value)
        return cls(**data)


def default_state_dir() -> Path:
    """TOWERFLOW_CLUSTER_DIR, else ~/.towerflow/cluster: outside the repository, so that no job's
    working directory ships its secrets or database."""
    return Path(os.environ.get("TOWERFLOW_CLUSTER_DIR") or Path.home() / ".towerflow" / "cluster").absolute()


def cluster_up(
    state_dir: Path | None = None,
    *,
    num_cpus: float | None = None,
    worker_ports: tuple[int, int] | None = None,
) -> ClusterState:
    """Start PostgreSQL, the tracking server and the Ray head; write cluster.json and env.sh. If one
    fails to start, stop those started and raise."""
    state_dir = Path(state_dir or default_state_dir()).absolute()
    previous = ClusterState.load(state_dir)
    if previous is not None and any(previous.running().values()):
        raise TowerflowError(
            f"a local cluster already runs from {state_dir} (towerflow cluster status); "
            "stop it with `towerflow cluster down` first"
        )
    if previous is not None and previous.ray_temp_dir is not None:
        # A head that crashed (or a machine that rebooted) left its session's files: nothing runs there.
        shutil.rmtree(previous.ray_temp_dir, ignore_errors=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    state_dir.chmod(0o700)
    token = credentials.ray_token(state_dir)
    username, password = credentials.mlflow_admin(state_dir)
    state = ClusterState(state_dir, data_dir_for(state_dir), mlflow_username=username)
    state.save()
    try:
        _log.info("starting PostgreSQL (data in %s)", state.postgres_data_dir)
        postgres = start_postgres(
            state.postgres_data_dir, password=credentials.postgres_password(state_dir).value
        )
        state.postgres_port, state.postgres_process = postgres.port, postgres.process
        state.save()
        # The head starts beside the tracking server (each takes seconds of a small machine's CPU,
        # and waits on I/O much of it); its jobs get the server's address, known in advance.
        mlflow_port = free_port()
        tracking = {
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
            credentials.MLFLOW_USERNAME_VAR: username,
            credentials.MLFLOW_PASSWORD_VAR: password.value,
        }
        _log.info("starting the Ray head (token authentication on)")
        launch = partial(
            _launch_and_record_head,
            state,
            token=token.value,
            log_path=state_dir / RAY_LOG,
            num_cpus=num_cpus,
            worker_ports=worker_ports,
            env=tracking,  # jobs on the head log to the tracking server without being told
        )
        head, head_process = launch()
        _log.info("starting the MLflow tracking server (basic-auth, artifacts proxied)")
        mlflow = start_tracking_server(
            postgres,
            state_dir,
            username=username,
            password=password.value,
            port=mlflow_port,
            on_started=partial(_record_tracking_server, state),
        )
        state.tracking_uri, state.mlflow_process = mlflow.url, mlflow.process
        state.artifacts_dir = mlflow.artifacts_dir
        state.save()
        wait_for_head(head, head_process, token.value, relaunch=launch)
    except BaseException:
        cluster_down(state_dir)
        raise
    credentials.write_private(state.env_file, env_script(state, token, password))
    return state


def _launch_and_record_head(state: ClusterState, **options) -> tuple[RayHead, subprocess.Popen]:
    """`launch_head(**options)`, the head written to cluster.json at once (a second start's too)."""
    head, process = launch_head(**options)
    state.ray_address, state.ray_gcs_address = head.dashboard_url, head.gcs_address
    state.ray_temp_dir, state.ray_process = head.temp_dir, head.process
    state.save()
    return head, process


def _record_tracking_server(state: ClusterState, process: ProcessRef) -> None:
    """The tracking server in cluster.json as soon as it starts: `up` killed while it waits for
    the server to answer (SIGTERM, a closed terminal) leaves it for `down` to stop."""
    state.mlflow_process = process
    state.save()


def cluster_down(state_dir: Path | None = None) -> list[str]:
    """Stop whatever the state directory's cluster runs (Ray head, tracking server, PostgreSQL; all
    at once, each takes seconds to wind down), keep its data. Returns the names of the servers that
    were running; [] when none was."""
    state_dir = Path(state_dir or default_state_dir()).absolute()
    state = ClusterState.load(state_dir)
    stops = {"postgres": lambda: stop_postgres(state.postgres_data_dir if state else data_dir_for(state_dir))}
    if state is not None and state.ray_process:
        stops["ray"] = lambda: stop_head(state.ray_process, state.ray_temp_dir)
    if state is not None and state.mlflow_process:
        stops["mlflow"] = lambda: stop_tree(state.mlflow_process)
    with ThreadPoolExecutor(len(stops)) as pool:
        done = {name: pool.submit(stop) for name, stop in stops.items()}
        stopped = {name for name, future in done.items() if future.result()}
    if state is not None:
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        state.env_file.unlink(missing_ok=True)
    return [name for name in ("ray", "mlflow", "postgres") if name in stopped]


def cluster_status(state_dir: Path | None = None) -> ClusterState | None:
    """The state directory's cluster as `up` recorded it (ask `.running()` what runs), or None."""
    return ClusterState.load(Path(state_dir or default_state_dir()).absolute())


def env_script(state: ClusterState, token: credentials.Secret, password: credentials.Secret) -> str:
    """env.sh: the exports that point a shell's `ray job`, `towerflow submit` and MLflow clients at
    the cluster. Secrets are read from their files, never spelled out."""
    lines = [
        "# towerflow cluster up: source this file to use the local cluster from a shell",
        f"export RAY_ADDRESS={state.ray_address}  # the job server (ray job submit, towerflow submit)",
        "export RAY_AUTH_MODE=token",
        token.export_line(),
        f"export MLFLOW_TRACKING_URI={state.tracking_uri}",
        f"export MLFLOW_TRACKING_USERNAME={state.mlflow_username}",
        password.export_line(),
    ]
    return "\n".join(lines) + "\n"


def _plain(value):
    return os.fspath(value) if isinstance(value, Path) else value
