"""Turn the workers' per-gradient records into one StepEvent per global step, in step order."""

from __future__ import annotations

import collections
import logging
import time

from towerflow.runtime.hooks import StepEvent
from towerflow.runtime.protocol import Verdict
from towerflow.runtime.worker_messages import StepRecord

PHASES = ("data", "pull", "compute", "push", "apply")
log = logging.getLogger(__name__)


class StepAggregator:
    """Groups applied gradients by the step they went into; counts dropped ones.

    Steps are dense (each shard version is one step), so they are reported in order: a step goes
    out once every step before it has and all the gradients it needs have been heard of. A worker
    records its step only when its push returns, so step 25's record can arrive a drain before
    step 24's; waiting for the gap to fill keeps every step in the hooks' view. A step waits for the
    records of the workers its shard aggregated (fewer once workers retire). A worker lost between its
    push and its record never sends the record: the controller writes it off (`write_off`), and the
    step goes out without it. A step still incomplete after `grace_s` goes out as it is.
    """

    def __init__(
        self,
        replicas_per_step: int,
        first_step: int = 1,
        window_s: float = 5.0,
        grace_s: float = 5.0,
        examples_seen: int = 0,
    ) -> None:
        self.replicas_per_step = replicas_per_step
        self._pending: dict[int, list[StepRecord]] = collections.defaultdict(list)
        self._first_heard: dict[int, float] = {}
        self._awaited: dict[int, set[int]] = {}  # step -> the workers whose records it waits for
        self._grace_s = grace_s
        self._dropped = 0
        self._last_emitted = first_step - 1
        self._start = time.time()
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._window_s = window_s
        self.examples_seen = examples_seen  # a resumed run counts on from its checkpoint's position
        self.first_step_at: float | None = None  # wall time the first update was heard of
        self.examples_after_first = 0
        self.dropped_total = 0
        self.rejected_total = 0
        self.overdue_total = 0  # steps that went out after the grace, records missing
        self.staleness: list[int] = []
        self.last_event: StepEvent | None = None

    def start(self) -> None:
        self._start = time.time()

    def add(self, records: list[StepRecord]) -> list[StepEvent]:
        nonfinite = []
        for record in records:
            if record.verdict == Verdict.NONFINITE:
                nonfinite.append(self._nonfinite_event(record))
            elif record.step > 0:
                self._pending[record.step].append(record)
                self._first_heard.setdefault(record.step, time.monotonic())
                if record.workers and record.step not in self._awaited:  # every record names the same
                    self._awaited[record.step] = set(record.workers)
            elif record.verdict == Verdict.STALE:
                self._dropped += 1
                self.dropped_total += 1
            elif record.verdict in (Verdict.REJECTED, Verdict.PARTIAL):
                self.rejected_total += 1
        return self._emit(final=False) + nonfinite

    def write_off(self, lost: set[int], step_workers: dict[int, tuple[int, ...]]) -> None:
        """`lost` workers' records will not come: the steps their gradients went into (`step_workers`,
        from the lead shard) wait only for the others' from the next `add` on. A step that only
        lost workers made goes by unreported."""
        for step, workers in step_workers.items():
            if step > self._last_emitted and lost.intersection(workers):
                self._awaited[step] = self._awaited.get(step, set(workers)) - lost

    @property
    def last_emitted(self) -> int:
        """The newest step reported (the one before the first, before any)."""
        return self._last_emitted

    def flush(self) -> list[StepEvent]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> list[StepEvent]:
        events = []
        now = time.monotonic()
        for step in sorted(self._pending.keys() | self._awaited.keys()):
            records = self._pending.get(step, [])
            if step > self._last_emitted and not final:
                in_order = step == self._last_emitted + 1 and self._complete(step, records)
                overdue = step in self._first_heard and now - self._first_heard[step] > self._grace_s
                if not (in_order or overdue):
                    break
                if not in_order:
                    self._report_overdue(step, records)
            self._pending.pop(step, None)
            self._first_heard.pop(step, None)
            self._awaited.pop(step, None)
            if step <= self._last_emitted:
                continue  # a late gradient of a step already reported
            if records:
                events.append(self._event(step, records))
            self._last_emitted = step
        return events

    def _report_overdue(self, step: int, records: list[StepRecord]) -> None:
        """A record lost and not written off held this step's report, and every later one's."""
        self.overdue_total += 1
        awaited, heard = self._awaited.get(step), {record.worker for record in records}
        if step > self._last_emitted + 1:
            missing = f"steps {self._last_emitted + 1}..{step - 1}, never heard of"
        elif awaited is not None:
            missing = f"the record of worker(s) {sorted(awaited - heard)}"
        else:
            missing = "a record"
        log.warning("step %d reported %.0f s late, without %s", step, self._grace_s, missing)

    def _complete(self, step: int, records: list[StepRecord]) -> bool:
        """Every record the step waits for is here: those of the workers it aggregated (but the
        written-off), or as many as a step takes where who is not known."""
        awaited = self._awaited.get(step)
        if awaited is None:
            return len(records) >= self.replicas_per_step
        return awaited <= {record.worker for record in records}

    def _event(self, step: int, records: list[StepRecord]) -> StepEvent:
        n = len(records)
        examples = sum(r.examples for r in records)
        self.examples_seen += examples
        now = max(r.finished_at for r in records)
        if self.first_step_at is None:
            self.first_step_at = now
        else:
            self.examples_after_first += examples
        self._window.append((now, examples))
        while len(self._window) > 2 and now - self._window[0][0] > self._window_s:
            self._window.popleft()
        span = self._window[-1][0] - self._window[0][0]
        in_window = sum(e for _, e in list(self._window)[1:])
        rate = in_window / span if span > 0 else None  # not known before two steps have ended
        metric_names = {k for r in records for k in r.metrics}
        staleness = [r.staleness for r in records]
        self.staleness.extend(staleness)
        dropped, self._dropped = self._dropped, 0
        event = StepEvent(
            global_step=step,
            loss=sum(r.loss for r in records) / n,
            metrics={k: sum(r.metrics.get(k, 0.0) for r in records) / n for k in sorted(metric_names)},
            examples=examples,
            examples_seen=self.examples_seen,
            elapsed_s=now - self._start,
            examples_per_sec=rate,
            time_split={p: sum(r.time_split.get(p, 0.0) for r in records) / n for p in PHASES},
            workers=sorted(r.worker for r in records),
            dropped_stale=dropped,
            staleness=staleness,
        )
        self.last_event = event
        return event

    def _nonfinite_event(self, record: StepRecord) -> StepEvent:
        """A worker's loss was not finite: nothing was applied, the step it was computing is named."""
        return StepEvent(
            global_step=record.version_read + 1,
            loss=record.loss,
            metrics={},
            examples=0,
            examples_seen=self.examples_seen,
            elapsed_s=record.finished_at - self._start,
            examples_per_sec=None,
            time_split={},
            workers=[record.worker],
            nonfinite=True,
        )

    def steady_examples_per_sec(self) -> float:
        """Throughput from the first update to the last: start-up (imports, data warm-up) excluded."""
        last = self.last_event
        if last is None or self.first_step_at is None:
            return 0.0
        span = last.elapsed_s - (self.first_step_at - self._start)
        return self.examples_after_first / span if span > 0 else 0.0


def past_step_events(records: list[StepRecord], examples_seen_after: int) -> list[StepEvent]:
    """The step events of records heard of after the fact (`Hook.on_past_steps`), in step order,
    each step with the records there are; the examples seen counted back from
    `examples_seen_after`, where the last of them left the data."""
    applied = [record.step for record in records if record.step > 0]
    if not applied:
        return []
    aggregator = StepAggregator(
        replicas_per_step=1,
        first_step=min(applied),
        examples_seen=examples_seen_after - sum(r.examples for r in records if r.step > 0),
    )
    events = aggregator.add(records) + aggregator.flush()
    return [event for event in events if not event.nonfinite]  # not steps: nothing of them was applied
