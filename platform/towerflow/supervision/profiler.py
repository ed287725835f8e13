"""Profiler: TensorFlow's profiler over global steps [a, b) on chosen workers, plus Ray's timeline.

Each chosen worker traces its own steps in the window (the trace TensorBoard's profile view
loads, `plugins/profile/<run>/*.xplane.pb`); at the end this hook stores the traces under
`profiles/worker-<k>/` and the Ray timeline of the same wall-clock window, as a Chrome trace,
under `profiles/ray_timeline.json`.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from towerflow.runtime.hooks import Hook, RunOutcome, SessionInfo
from towerflow.supervision.artifacts import ArtifactSink

log = logging.getLogger(__name__)


class ProfilerHook(Hook):
    def __init__(
        self,
        start_step: int,
        stop_step: int,
        workers: list[int],
        sink: ArtifactSink | Callable[[SessionInfo], ArtifactSink],
    ) -> None:
        self.start_step, self.stop_step, self.workers = start_step, stop_step, list(workers)
        self._sink = sink
        self.logged: list[str] = []

    def end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        if session.runtime is None or not session.runtime.workers or outcome.taken_over:
            return
        sink = self._sink(session) if callable(self._sink) else self._sink
        windows = []
        with tempfile.TemporaryDirectory(prefix="towerflow-profiles-") as scratch:
            root = Path(scratch)
            for worker, profile in session.runtime.profiles(self.workers).items():
                if not profile:
                    continue  # the window was never reached (run too short)
                windows.append(profile["window"])
                for relative, payload in profile["files"].items():
                    target = root / f"worker-{worker}" / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(payload)
            if not windows:
                log.warning(
                    "profiler: steps [%d, %d) were never run; no profile", self.start_step, self.stop_step
                )
                return
            start, stop = min(w[0] for w in windows), max(w[1] for w in windows)
            (root / "ray_timeline.json").write_text(json.dumps(ray_timeline(start, stop)))
            self.logged.append(sink.log_dir(root, "profiles"))


def ray_timeline(start_s: float, stop_s: float) -> list[dict]:
    """Ray's task/actor timeline (Chrome trace events) cut to the wall-clock window [start, stop]."""
    import ray

    events = ray.timeline()  # list of Chrome trace events; "ts" in microseconds since the epoch
    low, high = start_s * 1e6, stop_s * 1e6
    return [e for e in events if "ts" not in e or low <= float(e["ts"]) <= high]
