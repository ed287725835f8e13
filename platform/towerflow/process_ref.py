"""A process known by its pid and its start time: a pid alone could name a stranger once the process
is gone and its pid reused. Light to import: actors use it as they start (runtime/scratch.py).

The start time to match by is the kernel's: clock ticks from the machine's boot (Linux's
/proc/PID/stat), which no clock change moves. The wall-clock start time psutil gives is that plus
the boot time, which moves with the clock: where the clock is stepped (a VM paused, then its time
synced) /proc/stat's btime moves (by 21 s in 4 minutes on the CI machine, 2026-12-05), and live
processes looked gone. Where the kernel's count cannot be read (not Linux), the wall-clock time is
compared, with a second and a half of slack for such a step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

WALL_CLOCK_SLACK_S = 1.5  # a whole-second step of the boot time, and rounding


@dataclass(frozen=True)
class ProcessRef:
    """A process known by its pid and its start time."""

    pid: int
    create_time: float  # seconds since the epoch (psutil's): for people, and where `since_boot` is not known
    since_boot: float | None = None  # seconds from the machine's boot to its start, as the kernel counts

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, psutil.Process(pid).create_time(), started_since_boot(pid))

    def process(self) -> psutil.Process | None:
        """The process, or None once it is gone (or its pid names another process now)."""
        try:
            process = psutil.Process(self.pid)
            if not self._started_as(process) or process.status() == psutil.STATUS_ZOMBIE:
                return None
            return process
        except psutil.Error:
            return None

    def is_running(self) -> bool:
        return self.process() is not None

    def _started_as(self, process: psutil.Process) -> bool:
        if self.since_boot is not None and (now := started_since_boot(self.pid)) is not None:
            return abs(now - self.since_boot) < 0.005  # the same tick count (under half a tick at 100 Hz)
        return abs(process.create_time() - self.create_time) <= WALL_CLOCK_SLACK_S


def started_since_boot(pid: int) -> float | None:
    """Seconds from the machine's boot to process `pid`'s start, from the kernel's tick count (the
    22nd field of /proc/PID/stat); None where there is none to read (not Linux, or the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold spaces
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
