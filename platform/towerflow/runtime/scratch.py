"""A temporary directory of its own for each actor process, swept once that process is gone.

TensorFlow's autograph writes the Python it generates for each function it traces (a worker's
step: four files) to the temporary directory, and removes them at the process's exit. An actor
ends by being killed (the run's release, a lost node, a SIGKILL), so its files would never be
removed and a long-lived node (a KubeRay pod's /tmp is an emptyDir on the node's disk) would gather
them run after run. Each actor writes its temporary files under
`<tmp>/towerflow-scratch-<uid>/<pid>-b<start>/` (its start in ms from the machine's boot, as the
kernel counts it; `<pid>-<start>`, in ms since the epoch, where the kernel's count is not known),
and the next actor to start on the node removes the folders of processes no longer running.
Processes are told apart by their pid as this node's kernel sees it: the root must not be shared
between containers with PID namespaces of their own.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from towerflow.process_ref import ProcessRef

log = logging.getLogger(__name__)


def scratch_root(base: str | None = None) -> Path:
    """Where this user's actors keep their scratch folders: under `base` (default: the temp dir)."""
    return Path(base or tempfile.gettempdir()) / f"towerflow-scratch-{os.getuid()}"


def use_own_scratch_dir(base: str | None = None) -> Path | None:
    """Point this process's temporary files (`tempfile.tempdir`) at a folder of its own, after
    removing the folders of processes that are gone. None, and the temp dir left as it was, where
    the root is not a private folder of this user's (another user's, or a link planted there)."""
    root = scratch_root(base)
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
    except OSError as exc:
        log.warning("temporary files stay in %s: cannot make %s (%s)", tempfile.gettempdir(), root, exc)
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        log.warning(
            "temporary files stay in %s: %s is not a private folder of this user's",
            tempfile.gettempdir(),
            root,
        )
        return None
    me = ProcessRef.of(os.getpid())
    own = root / _folder_name(me)
    own.mkdir(exist_ok=True)
    sweep(root, keep=own)
    tempfile.tempdir = str(own)
    return own


def sweep(root: Path, *, keep: Path | None = None) -> list[str]:
    """Remove the scratch folders in `root` whose process is no longer running; their names."""
    removed = []
    for entry in root.iterdir():
        if entry == keep or not entry.is_dir() or _owner_runs(entry.name) is not False:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _folder_name(process: ProcessRef) -> str:
    if process.since_boot is not None:
        return f"{process.pid}-b{round(process.since_boot * 1000)}"
    return f"{process.pid}-{int(process.create_time * 1000)}"


def _owner_runs(name: str) -> bool | None:
    """Whether the process a folder is named after still runs (`ProcessRef`: the same pid, started
    at the same time); None for a name that is not `<pid>-b<start ms>` or `<pid>-<start ms>`."""
    pid, _, start = name.partition("-")
    since_boot = start.startswith("b")
    start_ms = start[1:] if since_boot else start
    if not (pid.isdigit() and start_ms.isdigit()):
        return None
    if since_boot:
        return ProcessRef(int(pid), 0.0, since_boot=int(start_ms) / 1000).is_running()
    return ProcessRef(int(pid), int(start_ms) / 1000).is_running()
