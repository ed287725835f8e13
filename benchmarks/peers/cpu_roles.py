"""CPU time of a local Ray's processes by role, for a runner that started that Ray (its driver).

The raylet, GCS and Ray's helper actors are children of the driver; workers and shards are children
of the raylet. Two samples around a timed window give the CPU each role used in it: the cost
model's per-process constants come from such a window (benchmarks/costmodel.py).
"""

from __future__ import annotations

import psutil

ROLES = {"TowerWorker": "workers", "ParameterShard": "shards"}  # anything else is "other"


def _role(process: psutil.Process) -> str:
    name = " ".join(process.cmdline()[:1])
    return next((role for marker, role in ROLES.items() if marker in name), "other")


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far: user + system) of this process and everything under it."""
    found = {}
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            found[process.pid] = (_role(process), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def used_between(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds used between two samples by role, each process counted in its role at the
    second (a Ray worker process becomes a TowerWorker after start-up). Processes that ended in
    between are missing: sample while the run trains."""
    used = {"workers": 0.0, "shards": 0.0, "other": 0.0}
    for pid, (role, seconds) in after.items():
        used[role] += seconds - before.get(pid, (role, 0.0))[1]
    return used
