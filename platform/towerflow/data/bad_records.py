"""`data.on_bad_record`: stop at the first bad record (error), or drop bad records and count them
per file (skip).

Parse tasks run in Ray Data worker processes, so skipped counts go to one small ledger actor; the
driver reads it through `SkippedRecordsHook`, which prints one line per file and logs
`bad_records_skipped` (total and per file) to the job's MLflow run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from towerflow.errors import DataError
from towerflow.runtime.hooks import Hook, RunContext, RunOutcome, SessionInfo, StepEvent


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
        """Send this file's count to the ledger (once, when the file is done)."""
        if self.skipped and self.ledger is not None:
            self.ledger.add.remote(path, self.skipped, self.first_reason or "")


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


class SkippedRecordsHook(Hook):
    """Reports skipped records: printed per file at the end, logged to MLflow while training runs."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.ledger: Any = None  # set by the data set-up once the ledger exists
        self.every_s = every_s
        self._last = 0.0
        self._step = 0
        self.counts: dict[str, int] = {}

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        import time

        self._step = event.global_step
        if self.ledger is not None and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self._log(context.session, self._fetch()[0])

    def end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        if self.ledger is None:
            return
        counts, reasons = self._fetch()
        for path, count in sorted(counts.items()):
            print(f"towerflow: skipped {count} bad record(s) in {path} (e.g. {reasons.get(path, '')})")
        self._log(session, counts, final=True)

    def _fetch(self) -> tuple[dict[str, int], dict[str, str]]:
        import ray

        try:
            counts, reasons = ray.get(self.ledger.snapshot.remote(), timeout=30)
        except Exception:  # the ledger is gone with a failed cluster: nothing more to say
            return self.counts, {}
        self.counts = counts
        return counts, reasons

    def _log(self, session: SessionInfo, counts: dict[str, int], final: bool = False) -> None:
        """Through the session's metric channel: the tracker buffers and logs them with the rest."""
        if not (counts or final):
            return
        metrics = {"bad_records_skipped": float(sum(counts.values()))}
        for path, n in sorted(counts.items())[:999]:
            metrics[f"bad_records_skipped/{metric_safe(path)}"] = float(n)
        session.log_metrics(metrics, self._step)


def metric_safe(path: str) -> str:
    """A file's name as an MLflow metric key part (letters, digits, _ - . / and spaces only)."""
    return re.sub(r"[^\w\-. /]", "_", PurePosixPath(path).name)[:200]
