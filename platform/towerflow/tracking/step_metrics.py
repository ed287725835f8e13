"""Figures over the steps between two logged steps: StepCounter's rates, staleness percentiles,
per-worker throughput. The tracker logs one value per figure every `log_every_steps`."""

from __future__ import annotations

import collections

import numpy as np

from towerflow.runtime.hooks import StepEvent


class StepWindow:
    def __init__(self, staleness: bool = True) -> None:
        self.staleness = staleness  # only async applies stale gradients worth describing
        self._events: list[StepEvent] = []
        self._previous: StepEvent | None = None
        self._dropped = 0

    def add(self, event: StepEvent) -> None:
        if event.nonfinite:
            return
        self._events.append(event)
        self._dropped += event.dropped_stale

    def metrics(self) -> dict[str, float]:
        """The window's figures; the window then starts afresh."""
        events, self._events = self._events, []
        if not events:
            return {}
        out: dict[str, float] = {}
        start = self._previous or events[0]
        span = events[-1].elapsed_s - start.elapsed_s
        steps = events[-1].global_step - start.global_step
        if span > 0 and steps > 0:
            out["global_step_per_sec"] = steps / span
            per_worker = collections.Counter()
            for event in events if self._previous else events[1:]:
                share = event.examples / max(1, len(event.workers))
                for worker in event.workers:
                    per_worker[worker] += share
            for worker, examples in sorted(per_worker.items()):
                out[f"worker_{worker}_examples_per_sec"] = examples / span
        staleness = [s for e in events for s in e.staleness] if self.staleness else []
        if staleness:
            values = np.asarray(staleness, dtype=np.float64)
            out.update(
                staleness_mean=float(values.mean()),
                staleness_p50=float(np.percentile(values, 50)),
                staleness_p99=float(np.percentile(values, 99)),
                staleness_max=float(values.max()),
            )
        out["dropped_stale"] = float(self._dropped)
        self._dropped = 0
        self._previous = events[-1]
        return out
