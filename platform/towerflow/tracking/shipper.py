"""MetricShipper: a run's metrics and tags go to the tracking server from a thread of their own.

The driver's loop hands batches over and goes on; the thread sends them in order. Where the
server does not answer (a tracking server restarted, its pod moved, the network away), a batch
that failed stays first in line and is tried again, with backoff, until the server takes it:
training never waits for the server, and nothing logged meanwhile is lost unless more than
`max_pending` metrics pile up (the oldest go first, counted and reported). A batch the server
answers and refuses (a bad value, no such run) is no outage: it is dropped, and `take_refusal`
hands the error to the driver to raise, as a write in its own loop would have.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from towerflow.tracking.store import server_unavailable

log = logging.getLogger(__name__)

BATCH = 1000  # MLflow's log_batch takes at most 1,000 metrics a call


@dataclass
class _Item:
    metrics: list[Any] = field(default_factory=list)
    tags: list[Any] = field(default_factory=list)


class MetricShipper:
    """`put` metrics and tags; `drain` waits until everything put was sent (at the run's end);
    `close` stops the thread. `send(metrics, tags)` writes one batch or raises; `transient(error)`
    says whether to try it again."""

    def __init__(
        self,
        send: Callable[[list[Any], list[Any]], None],
        *,
        transient: Callable[[BaseException], bool] = server_unavailable,
        max_pending: int = 1_000_000,
        backoff_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self._send = send
        self._transient = transient
        self._max_pending = max_pending
        self._backoff_s = backoff_s
        self._queue: collections.deque[_Item] = collections.deque()
        self._pending = 0  # metrics queued, not yet sent
        self._busy = False  # a batch is out, being sent
        self._closed = False
        self._cond = threading.Condition()
        self.dropped = 0  # metrics given up for room while the server was away
        self.failing_since: float | None = None  # monotonic time of the first failure of this outage
        self.last_error: BaseException | None = None
        self._refusals: list[BaseException] = []  # batches the server answered and refused
        self._thread = threading.Thread(target=self._run, name="towerflow-metric-shipper", daemon=True)
        self._thread.start()

    def put(self, metrics: Sequence[Any] = (), tags: Sequence[Any] = ()) -> None:
        metrics, tags = list(metrics), list(tags)
        if not metrics and not tags:
            return
        with self._cond:
            for start in range(0, max(len(metrics), 1), BATCH):
                chunk = metrics[start : start + BATCH]
                self._queue.append(_Item(chunk, tags if start == 0 else []))
                self._pending += len(chunk)
            self._make_room()
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything put so far was sent; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    def close(self, discard: bool = False) -> None:
        """Stop once what was put is sent (no batch is sent again after a failure from now on);
        `discard`: send nothing more (the run is another driver's now)."""
        with self._cond:
            self._closed = True
            if discard:
                self._queue.clear()
                self._pending = 0
            self._cond.notify_all()
        self._thread.join(timeout=5.0)

    @property
    def pending(self) -> int:
        return self._pending

    def _make_room(self) -> None:
        """Drop the oldest metrics past `max_pending`; tags stay (few, and they say what happened),
        and so does the batch being sent."""
        index = 1 if self._busy else 0
        while self._pending > self._max_pending and index < len(self._queue):
            item = self._queue[index]
            self._pending -= len(item.metrics)
            self.dropped += len(item.metrics)
            if item.tags:
                item.metrics = []
                index += 1
            else:
                del self._queue[index]

    def _run(self) -> None:
        delay = self._backoff_s[0]
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue[0]
                self._busy = True
            try:
                self._send(item.metrics, item.tags)
            except Exception as exc:
                if not self._transient(exc):
                    self._refusals.append(exc)
                    self._done(item)
                    continue
                self._failed(exc)  # the server is away: keep the batch first in line
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                    retry_at = time.monotonic() + delay
                    while not self._closed and (left := retry_at - time.monotonic()) > 0:
                        self._cond.wait(left)  # new batches wake it; they wait with the rest
                    if self._closed:
                        return
                delay = min(delay * 2, self._backoff_s[1])
                continue
            delay = self._backoff_s[0]
            self._done(item)
            self._recovered()

    def _done(self, item: _Item) -> None:
        with self._cond:
            if self._queue and self._queue[0] is item:  # the first in line stays there while it is
                self._queue.popleft()  # sent (unless a discard emptied the queue meanwhile)
                self._pending -= len(item.metrics)
            self._busy = False
            self._cond.notify_all()

    def take_refusal(self) -> BaseException | None:
        """The first batch refusal not taken yet (None if none)."""
        return self._refusals.pop(0) if self._refusals else None

    def _failed(self, exc: BaseException) -> None:
        self.last_error = exc
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.warning(
                "the tracking server did not take the run's metrics (%s); training goes on, and "
                "they are kept and sent again until it does",
                _short(exc),
            )

    def _recovered(self) -> None:
        if self.failing_since is not None:
            log.warning(
                "the tracking server takes the run's metrics again after %.0f s%s",
                time.monotonic() - self.failing_since,
                f"; {self.dropped:,} metrics were dropped for room meanwhile" if self.dropped else "",
            )
            self.failing_since = None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
