"""A worker's TensorFlow profiler trace over a window of global steps (supervision.profile)."""

from __future__ import annotations

import time
from typing import Any


class StepWindowProfiler:
    """TensorFlow's profiler over global steps [a, b) of this worker, written to a scratch directory."""

    def __init__(self, steps: tuple[int, int] | None) -> None:
        self.steps = steps
        self.logdir: str | None = None
        self.window: tuple[float, float] | None = None
        self._started_at: float | None = None

    def at_step(self, step: int) -> None:
        if self.steps is None:
            return
        first, stop = self.steps
        if self._started_at is None and self.window is None and first <= step < stop:
            import tempfile

            import tensorflow as tf

            self.logdir = tempfile.mkdtemp(prefix="towerflow-profile-")
            tf.profiler.experimental.start(self.logdir)
            self._started_at = time.time()
        elif self._started_at is not None and step >= stop:
            self.stop()

    def stop(self) -> None:
        if self._started_at is None:
            return
        import tensorflow as tf

        tf.profiler.experimental.stop()
        self.window = (self._started_at, time.time())
        self._started_at = None

    def collect(self) -> dict[str, Any] | None:
        if self.logdir is None or self.window is None:
            return None
        from pathlib import Path

        root = Path(self.logdir)
        files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        return {"files": files, "window": self.window}
