"""SkippedRecordsHook: the bad records that parse tasks skipped (`data.on_bad_record: skip`), read
from the data's ledger actor (data/bad_records.py), said per file at the end (a warning) and logged as
`bad_records_skipped` (total and per file) while training runs."""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import PurePosixPath
from typing import Any

from towerflow.runtime.hooks import Hook, RunContext, RunOutcome, SessionInfo, StepEvent

log = logging.getLogger(__name__)


class SkippedRecordsHook(Hook):
    """Reports skipped records: a warning per file at the end, metrics in MLflow while training runs."""

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
        if outcome.taken_over:  # the run is another driver's, with a ledger of its own
            self._end_ledger()
            return
        counts, reasons = self._fetch()
        for path, count in sorted(counts.items()):
            log.warning("skipped %d bad record(s) in %s (e.g. %s)", count, path, reasons.get(path, ""))
        self._log(session, counts, final=True)
        self._end_ledger()

    def _end_ledger(self) -> None:
        """The run is over, and its ledger's process with it (left to its handles going out of
        scope, it outlived the run: the read tasks' arguments carry one)."""
        import ray

        with contextlib.suppress(Exception):  # gone already with a failed cluster
            ray.kill(self.ledger)

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
