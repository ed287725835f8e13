"""The composition root: spec + data + runtime + tracking, wired together. The CLI only calls this."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from towerflow.runtime.hooks import Hook
from towerflow.runtime.result import TrainResult
from towerflow.spec import JobSpec, load_spec


def train(
    spec: JobSpec | str | Path,
    *,
    overrides: Iterable[str] = (),
    hooks: Sequence[Hook] = (),
    track: bool = True,
    worker_overrides: dict[int, dict[str, Any]] | None = None,
) -> TrainResult:
    """Run one training job to the end and return its result.

    `spec` is a JobSpec or the path of a YAML spec (`overrides` are `a.b=value` strings). Ray is
    reached through RAY_ADDRESS or started locally; MLflow through the spec's tracking_uri,
    MLFLOW_TRACKING_URI, or a store in the working directory.
    """
    from towerflow.data.ingest import build_training_data
    from towerflow.runtime.cluster import budget_for, ensure_ray
    from towerflow.runtime.driver import Driver

    if not isinstance(spec, JobSpec):
        spec = load_spec(spec, overrides)
    ensure_ray(budget_for(spec.cluster))
    all_hooks: list[Hook] = []
    if track:
        from towerflow.tracking import MLflowTracker

        all_hooks.append(MLflowTracker(spec))
    all_hooks.extend(hooks)

    skipped = None
    if spec.data.on_bad_record == "skip":
        from towerflow.data.bad_records import SkippedRecordsHook

        skipped = SkippedRecordsHook()
        all_hooks.insert(0, skipped)  # ends before the tracker closes the run (it logs to that run)

    def make_data(num_workers: int):
        data = build_training_data(spec, num_workers)
        if skipped is not None:
            skipped.ledger = data.ledger
        return data.splits, data.feature_scales

    return Driver(spec, all_hooks, make_data, worker_overrides=worker_overrides).run()
