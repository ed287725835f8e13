"""A Ray node started as `ray start --block` (tests/multinode.py): its process, temp dir and logs
(why it ended); its processes, found as the descendants of that process (Ray's workers sit in
process groups of their own), its raylet and the node id it was given, and how to stop them all;
and whether this machine lets a node start in a mount namespace of its own (a node that does not
see some folders)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

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


# Ray 2.60's restarted GCS fails this check of its own, and exits, when a placement group is removed
# whose lost bundle Ray placed again beside another after the GCS's restart (docs/reliability.md;
# tests/upstream/ray_placement_group_removal_after_head_restart.py reproduces it).
RAY_GCS_REMOVAL_CHECK = "All bundles in a RemovePlacementGroupBundles batch must target the same node"


@dataclass(eq=False)
class Node:
    """One node: its `ray start --block` process (a process group leader), temp dir and Ray node id."""

    name: str
    process: subprocess.Popen
    temp_dir: str
    num_cpus: float
    worker_ports: int  # first of its 100 worker ports
    resources: dict[str, float] | None = None
    args: tuple[str, ...] = ()  # its `ray start` options beyond the ones every node gets
    hidden: tuple[str, ...] = ()  # folders it cannot see (`LocalCluster.add_node`)
    drain_s: float = 0  # how long it drains on SIGTERM before it stops (`LocalCluster.add_node`)
    node_id: str = ""  # known once its raylet runs
    killed: bool = False

    @property
    def log(self) -> Path:
        """stdout and stderr of its `ray start` (a file, so a chatty node never blocks on a pipe)."""
        return Path(self.temp_dir) / "ray-start.log"

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    @property
    def exited_unasked(self) -> bool:
        """Its processes ended without the test's killing it."""
        return not self.killed and self.process.poll() is not None

    def exit_report(self, chars: int = 3000) -> str:
        """Why it ended: `ray start --block` ends the whole node when one of its processes exits
        and says which (its log), the GCS's last lines say whether it crashed, and the raylet's
        whether it was told it was dead (missed health checks)."""
        ended = "running" if self.process.returncode is None else f"exited ({self.process.returncode})"
        parts = [f"{self.name} {ended}; its ray start said:\n{self.log_tail(chars)}"]
        names = ("ray_process_exit.log", "gcs_server.err", "gcs_server.out", "raylet.err", "raylet.out")
        parts += [f"--- {path}:\n{text[-chars:]}" for path, text in self._session_logs(names)]
        return "\n".join(parts)

    def gcs_said(self, text: str) -> bool:
        """Whether this node's GCS (a head's) wrote `text` to its output: a check it failed, say."""
        return any(text in said for _, said in self._session_logs(("gcs_server.err", "gcs_server.out")))

    def _session_logs(self, names: Sequence[str]) -> Iterator[tuple[Path, str]]:
        for logs in sorted(Path(self.temp_dir).glob("session_2*/logs")):  # not session_latest, a link to one
            for name in names:
                with contextlib.suppress(OSError):
                    yield logs / name, (logs / name).read_text(errors="replace")
