"""The local cluster's Ray head: started again when `ray start` gives up on its raylet's
registration (a fixed 30 s wait that a busy small machine can miss)."""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading
import time

import psutil
import pytest

from towerflow.local_cluster import start_head
from towerflow.local_cluster.head import RAY_GAVE_UP_REGISTERING, TEMP_DIR_PREFIX
from towerflow.local_cluster.processes import http_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# Apart from the session's Ray (10002-19999), test_cluster_cli.py's head (21000-21099),
# tests/cli/test_job_submit.py's (23000-24999) and tests/multinode.py's nodes (25000-31999).
WORKER_PORTS = (21100, 21199)


def _freeze_the_first_head_raylet(frozen: list[psutil.Process]) -> None:
    """SIGSTOP the raylet of the first local-cluster head this process starts (not the session's
    Ray's, also a child of this process): alive, it never registers with its GCS."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.name() == "raylet" and any(
                    f"/tmp/{TEMP_DIR_PREFIX}" in arg for arg in process.cmdline()
                ):
                    process.send_signal(signal.SIGSTOP)
                    frozen.append(process)
                    return
        time.sleep(0.01)


def test_a_head_whose_raylet_never_registers_is_started_again(tmp_path):
    frozen: list[psutil.Process] = []
    watcher = threading.Thread(target=_freeze_the_first_head_raylet, args=(frozen,), daemon=True)
    watcher.start()
    token = secrets.token_hex(16)
    log = tmp_path / "ray-head.log"
    head = start_head(token=token, log_path=log, num_cpus=1, worker_ports=WORKER_PORTS)
    try:
        assert frozen, "no raylet was seen to freeze"
        assert RAY_GAVE_UP_REGISTERING in log.read_text()  # the first start gave up ...
        assert not frozen[0].is_running()  # ... and left no raylet behind
        version = f"{head.dashboard_url}/api/version"
        assert http_status(version, {"Authorization": f"Bearer {token}"}) == 200  # the second serves
    finally:
        head.stop()
    assert not head.process.is_running()
