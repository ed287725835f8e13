"""What a finished training job reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TrainResult:
    run_id: str | None
    status: str
    global_step: int
    final_loss: float | None
    final_metrics: dict[str, float]
    examples_seen: int
    examples_per_sec: float
    wall_s: float
    dropped_stale: int
    rejected: int
    staleness: dict[str, float]  # mean, p50, p99, max of applied gradients' staleness
    workers: list[dict[str, Any]] = field(default_factory=list)
    shards: list[dict[str, Any]] = field(default_factory=list)
    parameters: list[np.ndarray] | None = None  # trained variables in model order
    model_state: dict[str, np.ndarray] | None = None  # non-trainable variables by path (BN statistics)

    def summary_line(self) -> str:
        metrics = " ".join(f"{k}={v:.4f}" for k, v in self.final_metrics.items())
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.4f}"
        parts = [
            f"run {self.run_id or '-'}",
            self.status.lower(),
            f"steps={self.global_step}",
            f"loss={loss}",
            metrics,
            f"examples/sec={self.examples_per_sec:,.0f}",
        ]
        if self.dropped_stale:
            parts.append(f"dropped_stale={self.dropped_stale}")
        return " ".join(p for p in parts if p)


def staleness_summary(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }
