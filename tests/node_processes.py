"""The processes of a Ray node started as `ray start --block` (tests/multinode.py): found as the
descendants of that process (Ray's workers sit in process groups of their own), its raylet and the
node id it was given, and how to stop them all; and whether this machine lets a node start in a
mount namespace of its own (a node that does not see some folders)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil

MOUNT_NAMESPACE = ["unshare", "--mount", "--propagation", "private"]


def can_hide_folders() -> bool:
    """Whether nodes may be started with folders hidden from them (a mount namespace needs root,
    or CAP_SYS_ADMIN)."""
    probe = [*MOUNT_NAMESPACE, "sh", "-c", "mount -t tmpfs -o size=1m none /mnt"]
    with contextlib.suppress(OSError):
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    return False


def descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).children(recursive=True)
    return []


def is_raylet(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        cmdline = process.cmdline()
        return bool(cmdline) and os.path.basename(cmdline[0]) == "raylet"
    return False


def raylet_of(pid: int) -> psutil.Process | None:
    return next((p for p in descendants(pid) if is_raylet(p)), None)


def node_id_of(raylet: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        for arg in raylet.cmdline():
            if arg.startswith("--node_id="):
                return arg.split("=", 1)[1]
    return ""


def stop_processes(starts: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM each `ray start --block` (it stops what it started), then SIGKILL whatever is left."""
    leftovers = []
    for start in starts:
        leftovers += descendants(start.pid)  # workers too, which sit in process groups of their own
        with contextlib.suppress(ProcessLookupError):
            start.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for start in starts:
        try:
            start.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(start.pid, signal.SIGKILL)
            start.wait()
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.kill()
