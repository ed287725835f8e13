"""`towerflow ui`: the MLflow UI (`mlflow server`) over the store the runs were written to.

It binds to 127.0.0.1 unless told otherwise, like every local server of towerflow.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import BinaryIO

import psutil

from towerflow.errors import TowerflowError
from towerflow.tracking.store import default_tracking_uri, shown_address

DEFAULT_HOST = "127.0.0.1"  # every local server of towerflow binds to loopback unless told otherwise
DEFAULT_PORT = 5000


class UIError(TowerflowError):
    """The MLflow UI did not start (bad store URI, say); the message has its last output."""

    exit_code = 1


class PortInUse(UIError):
    """The port is taken (or the host is not this machine's): the user picks another."""

    exit_code = 2


class ServerStore(UIError):
    """The store is a tracking server, which serves its own UI: nothing to start."""

    exit_code = 2


def is_tracking_server(uri: str) -> bool:
    """Whether `uri` is a tracking server's address (its own UI lives there), not a store on disk
    or in a database."""
    return urllib.parse.urlsplit(uri).scheme in ("http", "https")


def run_page_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    """A run's page in the MLflow UI at `ui_url` (shown_address: no credentials)."""
    return f"{shown_address(ui_url)}/#/experiments/{experiment_id}/runs/{run_id}"


def ui_command(*, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> list[str]:
    """The `mlflow server` command line; the store goes in its environment (`ui_env`)."""
    return [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1"]


def ui_env(store_uri: str | None = None) -> dict[str, str]:
    """The server's environment, with `store_uri` (default: default_tracking_uri()) as its backend
    store: there, not on the command line, where `ps` shows a database's password to every user."""
    return {
        **os.environ,
        "MLFLOW_BACKEND_STORE_URI": default_tracking_uri(store_uri),
        # No job runner: its consumer processes serve GenAI evaluation, which towerflow does not use.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }


def start_ui(
    store_uri: str | None = None,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    timeout_s: float = 120.0,
    log: BinaryIO | None = None,
) -> subprocess.Popen:
    """Start the MLflow UI and return its process once it answers on http://host:port/health.

    Its output goes to `log` (default: a temporary file, shown in the error if it fails to start)."""
    store = default_tracking_uri(store_uri)
    if is_tracking_server(store):
        raise ServerStore(
            f"the store {shown_address(store)} is a tracking server: open it in a "
            "browser (its UI is its own); `towerflow ui` serves a store on disk or in a database"
        )
    _check_port_free(host, port)
    log = log or tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        ui_command(host=host, port=port), env=ui_env(store), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        _wait_until_it_answers(process, log, f"http://{host}:{port}/health", timeout_s)
    except BaseException:  # a Ctrl-C or SIGTERM while it starts stops it too
        stop_ui(process)
        raise
    return process


def _wait_until_it_answers(process: subprocess.Popen, log: BinaryIO, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            output = log.read().decode(errors="replace")[-3000:]
            raise UIError(f"the MLflow UI exited with code {process.returncode} ({url}):\n{output}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise UIError(f"the MLflow UI did not answer on {url} within {timeout_s:.0f} s")


def _check_port_free(host: str, port: int) -> None:
    """Refuse a taken port up front: another server there (an MLflow UI over another store, often)
    would answer the health check in ours' place, and we would point the user at it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does: TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PortInUse(
                f"cannot serve on {host}:{port}: {exc.strerror}. Pass --port with a free port."
            ) from None


def stop_ui(process: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Stop the server and every process it started (SIGTERM, then SIGKILL): its workers do not
    all end with it."""
    from towerflow.local_cluster.processes import stop_tree
    from towerflow.process_ref import ProcessRef

    if process.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile
            stop_tree(ProcessRef.of(process.pid), timeout_s=timeout_s)
    process.wait()
