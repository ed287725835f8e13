"""`data.on_bad_record`: stop at the first bad record (error), or drop bad records and count them
per file (skip).

Parse tasks run in Ray Data worker processes, so skipped counts go to one small ledger actor; the
driver reads it through `SkippedRecordsHook` (supervision/skipped_records.py), which prints one line per file and logs
`bad_records_skipped` (total and per file) to the job's MLflow run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from towerflow.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class BadRecords:
    """What a reader does with a bad record; counts the skipped ones of one file."""

    mode: str = "error"  # "error" | "skip"
    ledger: Any = None  # actor handle of a SkippedRecordsLedger, in skip mode
    skipped: int = 0
    first_reason: str | None = field(default=None)

    def bad(self, path: str, where: str, reason: str, count: int = 1) -> None:
        """Raise a DataError naming the file and the record (error), or count it (skip)."""
        if self.mode == "error":
            raise DataError(f"{path}: {where}: {reason}")
        self.skipped += count
        self.first_reason = self.first_reason or f"{where}: {reason}"

    def report(self, path: str) -> None:
        """Send this file's count to the ledger (once, when the file is done); with no ledger (the
        evaluation's reads), log it."""
        if not self.skipped:
            return
        if self.ledger is not None:
            self.ledger.add.remote(path, self.skipped, self.first_reason or "")
        else:
            log.warning("%s: %d bad record(s) skipped (%s)", path, self.skipped, self.first_reason)


class SkippedRecordsLedger:
    """Ray actor: the bad records of each file that parse tasks skipped, across a job's tasks."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.reasons: dict[str, str] = {}

    def add(self, path: str, count: int, reason: str) -> None:
        # Every whole read of a file finds the same bad records: again in each epoch, and again
        # when Ray Data retries a task. Keep the file's count, not a sum over its reads.
        self.counts[path] = max(self.counts.get(path, 0), count)
        self.reasons.setdefault(path, reason)

    def snapshot(self) -> tuple[dict[str, int], dict[str, str]]:
        return dict(self.counts), dict(self.reasons)


def make_ledger():
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(SkippedRecordsLedger).remote()
