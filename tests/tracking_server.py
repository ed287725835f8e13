"""A real authenticated MLflow tracking server for tests: PostgreSQL backend store, basic-auth,
artifacts proxied by the server, all on 127.0.0.1 (towerflow.local_cluster starts the parts).

A test module imports `tracking_server_fixture` (noqa: F401) and asks for `tracking_server`; it
gets an `AuthenticatedServer`, whose `env` is what a client (this process, a subprocess, a Ray job)
needs: MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD. One server
serves the whole session (starting one costs 10-13 s on 2 cores; the modules that use it keep to
experiments of their own). The fixture stops both servers at the end, checks that none of their
processes is left, and removes the database.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest

from towerflow.local_cluster import (
    PostgresServer,
    TrackingServer,
    data_dir_for,
    start_postgres,
    start_tracking_server,
)


@dataclass(frozen=True)
class AuthenticatedServer:
    """A running tracking server, its admin's credentials and the PostgreSQL under it."""

    uri: str
    username: str
    password: str = field(repr=False)
    server: TrackingServer
    postgres: PostgresServer
    database: str = "mlflow"

    @property
    def env(self) -> dict[str, str]:
        return {
            "MLFLOW_TRACKING_URI": self.uri,
            "MLFLOW_TRACKING_USERNAME": self.username,
            "MLFLOW_TRACKING_PASSWORD": self.password,
        }


def process_tree(pid: int) -> list[psutil.Process]:
    """A process and its descendants (empty once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def still_running(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        except psutil.Error:
            pass
    return alive


@pytest.fixture(scope="session", name="tracking_server")
def tracking_server_fixture(tmp_path_factory) -> Iterator[AuthenticatedServer]:
    state_dir = tmp_path_factory.mktemp("tracking-server")
    password = secrets.token_urlsafe(18)
    postgres = start_postgres(data_dir_for(state_dir), password=secrets.token_hex(16))
    processes = process_tree(postgres.process.pid)
    try:
        server = start_tracking_server(postgres, state_dir, username="admin", password=password)
        processes += process_tree(server.process.pid)
        try:
            yield AuthenticatedServer(server.url, "admin", password, server, postgres)
        finally:
            server.stop()
    finally:
        postgres.stop()
        shutil.rmtree(postgres.data_dir, ignore_errors=True)
    left = still_running(processes)
    assert not left, f"processes left after the tracking server stopped: {left}"
