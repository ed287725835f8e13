"""`towerflow cluster leave`: this machine's Ray node leaves its cluster as a stopped pod's should.

A node's `ray start --block` that gets SIGTERM first marks the node draining for up to
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (Ray's default 30 s; less where nothing runs there), then
stops what it started. A towerflow run with a shard on it keeps memory checkpoints every few
seconds meanwhile (runtime/draining.py), so the node's end redoes seconds of steps. `ray stop`, the
preStop of KubeRay's examples, ends the raylet at once instead: no drain, no notice. In a KubeRay
pod the container's first process, which Kubernetes signals, is the shell that runs `ray start`:
the pod's preStop runs this command to reach `ray start` itself, and waits for it, since the
kubelet kills the container once preStop returns (or its grace period runs out).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import psutil

from towerflow.errors import TowerflowError

log = logging.getLogger(__name__)
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
RAY_DRAIN_DEFAULT_S = 30.0  # Ray's, where DRAIN_ENV is not set
STOP_S = 15.0  # beyond the drain: `ray start` stopping what it started


def leave_cluster(pid: int | None = None) -> float:
    """SIGTERM this machine's `ray start --block` (or the process `pid`) and wait until it has
    drained its node and stopped; returns the seconds it took."""
    processes = [psutil.Process(pid)] if pid is not None else ray_start_processes()
    if not processes:
        raise TowerflowError("no `ray start --block` runs here: there is no Ray node to stop")
    drain_s = float(os.environ.get(DRAIN_ENV, RAY_DRAIN_DEFAULT_S))
    started = time.monotonic()
    for process in processes:
        log.info("stopping Ray's node process %d; its node drains for up to %g s", process.pid, drain_s)
        process.terminate()
    deadline = started + drain_s + STOP_S
    while (alive := [p.pid for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive:
        log.warning("Ray's node process(es) %s still run after %g s", alive, drain_s + STOP_S)
    return time.monotonic() - started


def _running(process: psutil.Process) -> bool:
    """Alive, not a zombie (one whose parent has not reaped it yet has ended all the same)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ray_start_processes() -> list[psutil.Process]:
    """Every `ray start --block` on this machine (in a pod, its one)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        args = process.info["cmdline"] or []
        named = [Path(arg).name for arg in args]
        if process.pid != os.getpid() and "--block" in args and _runs_ray_start(named):
            found.append(process)
    return found


def _runs_ray_start(names: list[str]) -> bool:
    return any(name == "ray" and names[i + 1 : i + 2] == ["start"] for i, name in enumerate(names))
