"""Detached server processes: start one that outlives its starter, find it again, stop it.

`towerflow cluster up` returns while its servers run on, and `down` (another process) stops them by
the pids in the state file. A pid alone could name a stranger once the server is gone and the pid
reused, so a `ProcessRef` carries the process's start time as well and is only acted on while both
match.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from towerflow.errors import TowerflowError
from towerflow.process_ref import ProcessRef


class ServerError(TowerflowError):
    """A local server did not start; the message names its log file."""

    exit_code = 1


def start_detached(
    command: Sequence[str], *, log_path: Path, env: Mapping[str, str], cwd: Path | None = None
) -> subprocess.Popen:
    """Start `command` as the leader of a session of its own (so a Ctrl-C in the starter's terminal
    does not reach it, and its process group can be stopped as one), output appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )


def stop_tree(
    ref: ProcessRef, timeout_s: float = 30.0, grace_s: float = 5.0, *, whole_group: bool = True
) -> bool:
    """SIGTERM the process (its whole group when it leads one and `whole_group`), wait up to
    `timeout_s` for it, then `grace_s` for its descendants (Ray's workers leave their parent's
    process group), and SIGKILL whatever is left. Returns whether there was anything to stop.
    `whole_group=False` is for a leader that stops its own children in an order of its own."""
    process = ref.process()
    if process is None:
        return False
    try:
        tree = [process, *process.children(recursive=True)]
    except psutil.Error:
        tree = [process]
    try:
        leads_group = os.getpgid(ref.pid) == ref.pid
        if leads_group and whole_group:
            os.killpg(ref.pid, signal.SIGTERM)
        else:
            process.terminate()
    except (ProcessLookupError, PermissionError, psutil.Error):
        pass
    _, alive = psutil.wait_procs([process], timeout=timeout_s)
    _, alive = psutil.wait_procs([p for p in tree if p not in alive] + alive, timeout=grace_s)
    for straggler in alive:
        with contextlib.suppress(psutil.Error):
            straggler.kill()
    psutil.wait_procs(alive, timeout=5)
    _reap(ref.pid)
    return True


def _reap(pid: int) -> None:
    """Collect the exit status of a child of this process (a server started and stopped by the same
    process, as in tests), so that it leaves no zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the server that takes it binds it a moment later)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports (all held open until every one is chosen)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in probes]


def wait_until(
    ready: Callable[[], bool],
    *,
    process: subprocess.Popen | None,
    what: str,
    log_path: Path,
    timeout_s: float,
) -> None:
    """Poll `ready` until it holds; fail naming `log_path` (and its tail) if `process` exits first
    or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerError(f"{what} exited with code {process.returncode}; {log_tail(log_path)}")
        if ready():
            return
        time.sleep(0.3)
    raise ServerError(f"{what} did not become ready within {timeout_s:.0f} s; {log_tail(log_path)}")


def log_tail(log_path: Path, chars: int = 2000) -> str:
    """'its log, PATH, ends with: ...' for an error message."""
    try:
        tail = log_path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return f"its log would be {log_path} (not written)"
    return f"its log, {log_path}, ends with:\n{tail}"


def http_ok(url: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether GET `url` answers 200 (within 2 s)."""
    return http_status(url, headers, timeout_s=2) == 200


def http_json(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 2) -> Any:
    """The JSON body of GET `url` when it answers 200, else None (no answer, another status, not JSON)."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.load(reply)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


def http_status(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 30) -> int | None:
    """The HTTP status of GET `url`, or None when nothing answers."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
