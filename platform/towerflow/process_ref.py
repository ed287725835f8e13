"""A process known by its pid and its start time: a pid alone could name a stranger once the process
is gone and its pid reused. Light to import: actors use it as they start (runtime/scratch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessRef:
    """A process known by its pid and its start time (psutil's create_time)."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, psutil.Process(pid).create_time())

    def process(self) -> psutil.Process | None:
        """The process, or None once it is gone (or its pid names another process now)."""
        try:
            process = psutil.Process(self.pid)
            if (
                abs(process.create_time() - self.create_time) > 0.5
                or process.status() == psutil.STATUS_ZOMBIE
            ):
                return None
            return process
        except psutil.Error:
            return None

    def is_running(self) -> bool:
        return self.process() is not None
