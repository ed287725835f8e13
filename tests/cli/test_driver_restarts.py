"""`training.failure.driver_restarts`: the command starts its driver again where a signal killed it.

The children here are small Python programs standing in for the driver (the real driver's restart,
taking its run's live shards and workers over, is test_multinode_driver_loss.py's): they kill themselves
with a real SIGKILL, exit, or wait for a stop signal, and say what they were started with.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from towerflow.cli.driver_restarts import RESTART_ENV, RUN_ID_FILE_ENV

# argv: a log file, then the resume the supervisor gave. Notes its run id (as the real driver's run
# hook does), logs its start, then does what the log's length says: SIGKILL itself the first
# `KILLS` times, then exit with `EXIT_CODE`; with `STOP`, wait for SIGTERM and exit 143 on it.
CHILD = f"""
import json, os, signal, sys, time
from pathlib import Path

log, resume = Path(sys.argv[1]), sys.argv[2]
starts = log.read_text().splitlines() if log.exists() else []
Path(os.environ["{RUN_ID_FILE_ENV}"]).write_text("run-abc")
restart = os.environ.get("{RESTART_ENV}")
start = {{"resume": resume, "pid": os.getpid(), "pgid": os.getpgid(0), "restart": restart}}
log.write_text("\\n".join([*starts, json.dumps(start)]))
if os.environ.get("STOP"):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    time.sleep(60)
if len(starts) < int(os.environ.get("KILLS", "0")):
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""

# Supervises CHILD as `towerflow train` does, with argv[1] restarts, the first start resuming argv[2].
SUPERVISOR = """
import logging, sys
from towerflow.cli.driver_restarts import supervise_driver

logging.basicConfig(level=logging.INFO, format="towerflow: %(message)s")
log, restarts, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
child = [sys.executable, "-c", sys.argv[4], log]
sys.exit(supervise_driver(lambda r: [*child, str(r)], restarts, resume))
"""


def _supervise(tmp_path: Path, restarts: int, resume: str = "", **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path / "starts"), str(restarts), resume, CHILD],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _starts(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "starts").read_text().splitlines()]


def test_a_killed_driver_is_started_again_resuming_the_run_it_noted(tmp_path):
    supervisor = _supervise(tmp_path, restarts=2, KILLS="1")
    out, _ = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0, out
    first, second = _starts(tmp_path)
    assert (first["resume"], second["resume"]) == ("None", "run-abc")
    assert (first["restart"], second["restart"]) == (None, "1")  # a restart may start the run over
    assert (
        f"the driver (pid {first['pid']}) was killed (SIGKILL); starting it again to resume run run-abc "
        in out
    )
    assert "(restart 1 of 2)" in out
    assert first["pgid"] == first["pid"] != supervisor.pid  # a process group of its own


def test_restarts_end_with_the_last_kill_as_a_shell_reports_it(tmp_path):
    supervisor = _supervise(tmp_path, restarts=1, resume="auto", KILLS="5")
    out, _ = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 128 + signal.SIGKILL, out
    assert [s["resume"] for s in _starts(tmp_path)] == ["auto", "run-abc"]
    assert "the driver was killed again (SIGKILL), after 1 restart(s)" in out


def test_a_driver_that_exits_is_not_started_again_whatever_its_code(tmp_path):
    supervisor = _supervise(tmp_path, restarts=3, EXIT_CODE="2")  # as on bad input
    out, _ = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 2, out
    assert len(_starts(tmp_path)) == 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_reaches_the_driver_once_and_is_not_followed_by_a_restart(tmp_path, signum):
    supervisor = _supervise(tmp_path, restarts=3, STOP="1")
    deadline = time.monotonic() + 30
    while not (tmp_path / "starts").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.send_signal(signum)  # SIGINT as Ctrl-C at a terminal; SIGTERM as `ray job stop`
    out, _ = supervisor.communicate(timeout=60)
    # The child turned SIGTERM into 143; SIGINT, forwarded as SIGINT, ended it as Python ends on
    # an uncaught KeyboardInterrupt (by the signal: 128 + 2), and is not taken for a kill.
    assert supervisor.returncode == (143 if signum == signal.SIGTERM else 130), out
    assert len(_starts(tmp_path)) == 1


def test_a_killed_supervisor_takes_its_driver_with_it(tmp_path):
    supervisor = _supervise(tmp_path, restarts=3, STOP="1")
    deadline = time.monotonic() + 30
    while not (tmp_path / "starts").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = _starts(tmp_path)
    supervisor.kill()
    supervisor.wait()
    deadline = time.monotonic() + 10
    while _alive(child["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (not yet reaped by init) is dead
        return stat.read().split(") ")[1][0] != "Z"


def test_auto_restarts_a_driver_on_a_cluster_and_not_on_the_embedded_ray(monkeypatch):
    from towerflow.cli.driver_restarts import ON_A_CLUSTER, restarts_wanted

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a Ray job's entrypoint has it
    assert restarts_wanted("auto") == ON_A_CLUSTER == 2
    assert restarts_wanted(0) == 0 and restarts_wanted(5) == 5
    monkeypatch.delenv("RAY_ADDRESS")
    if not _joined_ray():  # (this session's own Ray, where a test before started one, is embedded)
        assert restarts_wanted("auto") == 0


def _joined_ray() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
