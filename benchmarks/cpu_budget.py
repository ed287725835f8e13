"""Where the machine's CPU goes during a run, role by role, in core-milliseconds per training step.

A step of T ms on C cores has C x T core-ms to spend; a snapshot before and after a window of steps
shows who spent them (the trainer, the shards, Ray Data, Ray's own processes, the driver, anything
else) and how many stayed idle. Processes that end inside the window drop out of it.

The second part measures other jobs on a shared machine: how many cores processes outside the
benchmark's own tree used during a run, and a wait for them to go quiet before the next one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import psutil

ROLES = ("trainer", "shards", "data", "ray", "driver", "other", "idle")
_RAY_SYSTEM = (
    "raylet",
    "gcs_server",
    "dashboard",
    "log_monitor",
    "monitor.py",
    "ray::IDLE",
    "DashboardAgent",
)


def role_of(pid: int, cmdline: str, trainer_pid: int | None = None) -> str:
    if pid == trainer_pid or cmdline.startswith("ray::TowerWorker"):
        return "trainer"
    if cmdline.startswith("ray::ParameterShard"):
        return "shards"
    if pid == os.getpid():
        return "driver"
    if any(name in cmdline for name in _RAY_SYSTEM):
        return "ray"
    if cmdline.startswith("ray::"):  # Ray Data's coordinator, read and map tasks, its stats actors
        return "data"
    return "other"


def snapshot(trainer_pid: int | None = None) -> dict[str, float]:
    """CPU seconds by role so far, idle included, and the wall clock under "wall"."""
    spent = dict.fromkeys(ROLES, 0.0)
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            cmdline = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or ""
            spent[role_of(proc.info["pid"], cmdline, trainer_pid)] += times.user + times.system
    machine = psutil.cpu_times()
    spent["idle"] = machine.idle + getattr(machine, "iowait", 0.0)
    spent["wall"] = time.perf_counter()
    return spent


def per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Core-ms per step by role, and "available": the cores times the wall time of a step."""
    budget = {role: 1000 * (after[role] - before[role]) / steps for role in ROLES}
    budget["available"] = 1000 * (after["wall"] - before["wall"]) * (os.cpu_count() or 1) / steps
    return budget


# -- other jobs on a shared machine --------------------------------------------------------------
def benchmark_snapshot() -> tuple[float, dict[int, float]]:
    """(CPU seconds the machine has been busy, CPU seconds of each process of this benchmark's tree).

    A process counts its reaped children, so a finished Keras child is not lost; actors that Ray
    killed meanwhile are dropped from the comparison rather than counted as foreign.
    """
    t = psutil.cpu_times()  # guest time is already inside user time
    busy = (
        t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)
    )
    mine = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            mine[proc.pid] = sum(proc.cpu_times()[:4])  # user, system, children_user, children_system
    return busy, mine


def foreign_cores(before: tuple[float, dict[int, float]], seconds: float) -> float:
    """Cores that processes outside this benchmark used since `before`, on average."""
    busy, mine = benchmark_snapshot()
    ours = sum(cpu - before[1].get(pid, 0.0) for pid, cpu in mine.items())
    return max(0.0, busy - before[0] - ours) / seconds


def wait_for_quiet(
    limit_s: float, log: Callable[[str], None], cores: float = 0.2, window_s: float = 3.0
) -> float:
    """Wait (up to limit_s) until other processes use under `cores` CPUs over `window_s`; return their load."""
    deadline = time.time() + limit_s
    while True:
        before = benchmark_snapshot()
        time.sleep(window_s)
        load = foreign_cores(before, window_s)
        if load < cores or time.time() > deadline:
            return load
        log(f"  other processes use {load:.2f} cores; waiting for a quiet machine")
