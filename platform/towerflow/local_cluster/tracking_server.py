"""An MLflow tracking server as the cluster path wants one: PostgreSQL backend store, artifacts
proxied by the server (runs get `mlflow-artifacts:` URIs, so no node needs a shared disk), MLflow's
basic-auth app on, listening on 127.0.0.1.

The admin account is created on the server's first start from MLFLOW_AUTH_ADMIN_USERNAME and
MLFLOW_AUTH_ADMIN_PASSWORD, which the server gets in its environment; the basic-auth app's ini
file (written to the state directory, 0600) holds only the user store's address, never a secret.
The user store sits in the same database as the runs (its migrations have a table of their own).
"""

from __future__ import annotations

import base64
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from towerflow.local_cluster.credentials import write_private
from towerflow.local_cluster.postgres import PostgresServer
from towerflow.local_cluster.processes import (
    ProcessRef,
    ServerError,
    free_port,
    http_ok,
    http_status,
    start_detached,
    stop_tree,
    wait_until,
)

AUTH_APP = "basic-auth"
MLFLOW_LOG = "mlflow-server.log"


@dataclass(frozen=True)
class TrackingServer:
    """A running `mlflow server`: its URL, where proxied artifacts land, its log and process."""

    url: str
    artifacts_dir: Path
    log_path: Path
    process: ProcessRef

    def stop(self) -> bool:
        return stop_tree(self.process)


def start_tracking_server(
    postgres: PostgresServer,
    state_dir: Path,
    *,
    username: str,
    password: str,
    database: str = "mlflow",
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout_s: float = 180.0,
    on_started: Callable[[ProcessRef], None] | None = None,
) -> TrackingServer:
    """Start `mlflow server --app-name basic-auth` over `database` on `postgres` (created if absent),
    artifacts under state_dir/artifacts, admin `username`/`password`. Returns once it answers and
    the admin's credentials are accepted. `on_started`: told the server's process as soon as it is
    started (a caller killed while it waits can then still stop it)."""
    state_dir = Path(state_dir).absolute()
    postgres.create_database(database)
    artifacts = state_dir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    config = write_auth_config(state_dir / "basic_auth.ini", postgres.uri(database))
    log = state_dir / MLFLOW_LOG
    port = port or free_port(host)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "MLFLOW_"))}
    env.update(
        postgres.client_env(),
        MLFLOW_AUTH_CONFIG_PATH=str(config),
        MLFLOW_AUTH_ADMIN_USERNAME=username,
        MLFLOW_AUTH_ADMIN_PASSWORD=password,
        # The basic-auth app's CSRF key; a new one each start (it signs browser form tokens only).
        MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(32),
        # No job runner: its eight consumer processes serve GenAI evaluation, which towerflow does
        # not use, and their start-up costs a small machine most of a minute.
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
    )
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres.uri(database)]
    command += ["--artifacts-destination", str(artifacts), "--serve-artifacts", "--app-name", AUTH_APP]
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    process = start_detached(command, log_path=log, env=env, cwd=state_dir)
    server = TrackingServer(f"http://{host}:{port}", artifacts, log, ProcessRef.of(process.pid))
    try:
        if on_started is not None:
            on_started(server.process)
        wait_until(
            lambda: http_ok(f"{server.url}/health"),
            process=process,
            what=f"the MLflow server on {host}:{port}",
            log_path=log,
            timeout_s=timeout_s,
        )
        # The first authenticated request can take seconds (a slow password hash, cold connections).
        checked = http_status(
            f"{server.url}/api/2.0/mlflow/experiments/get?experiment_id=0", auth_header(username, password)
        )
        if checked in (401, 403):
            afresh = sorted({str(state_dir), str(postgres.data_dir)})  # the database may lie elsewhere
            raise ServerError(
                f"the MLflow server at {server.url} refuses the credentials of {username!r}. Its admin "
                "account was made on its first start, with the password of that time: use that password "
                f"(MLFLOW_TRACKING_PASSWORD), or stop the cluster and remove {' and '.join(afresh)} "
                "to start afresh (its runs go with them)"
            )
        if checked != 200:  # no answer, or a server that cannot serve (its database, its user store)
            said = "no answer within 30 s" if checked is None else f"HTTP {checked}"
            raise ServerError(
                f"the MLflow server at {server.url} answers its health check but not an authenticated "
                f"request ({said}); its log: {log}"
            )
    except BaseException:
        server.stop()
        raise
    return server


# How long the server trusts a checked password. Without it, every request checks the password
# hash (scrypt, 0.2 s of CPU here by design), and a checkpoint's listing, a dozen requests, took
# seconds. A password changed through MLflow's API takes effect at once on the server's worker
# that changed it; elsewhere, and for changes made in the database, after this long.
AUTH_CACHE_TTL_S = 60


def write_auth_config(path: Path, database_uri: str) -> Path:
    """The basic-auth app's ini: its user store and defaults; no credentials. Readable by its owner only."""
    text = (
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = {database_uri}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n"
    )
    return write_private(path, text)


def auth_header(username: str, password: str) -> dict[str, str]:
    """HTTP basic authentication, as MLflow's clients send MLFLOW_TRACKING_USERNAME/PASSWORD."""
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}
