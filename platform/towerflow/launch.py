"""The composition root: spec + data + runtime + supervision + tracking, wired together.

The CLI only calls this.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Literal

from towerflow import messages
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook, SessionInfo
from towerflow.runtime.result import TrainResult
from towerflow.shared_types import StepShape
from towerflow.spec import JobSpec, load_spec

log = logging.getLogger(__name__)

AUTO_RESUME = "auto"  # resume=: the newest unfinished run of the job, if any (tracking/auto_resume.py)


def train(
    spec: JobSpec | str | Path,
    *,
    overrides: Iterable[str] = (),
    hooks: Sequence[Hook] = (),
    track: bool = True,
    resume: str | None = None,
    faults: FaultInjector | None = None,
    output_dir: str | Path | None = None,
    parent_run_id: str | None = None,
    if_nothing_to_resume: Literal["fail", "start_over"] = "fail",
) -> TrainResult:
    """Run one training job to the end and return its result.

    `spec` is a JobSpec or the path of a YAML spec (`overrides` are `a.b=value` strings). Ray is
    reached through RAY_ADDRESS or started locally; MLflow through the spec's tracking_uri,
    MLFLOW_TRACKING_URI, or a store in the working directory. `resume` is the MLflow run id of an
    earlier run of this job: its latest checkpoint is restored (onto however many shards this
    spec has) and the same run goes on; "auto" picks the newest unfinished run of the job, or
    starts a new one. Without tracking, checkpoints and profiles go under
    `output_dir` (default `runs/<job name>`), and `resume` is that directory. `parent_run_id`
    makes the run a child of that MLflow run. A tracked run resumed with neither a checkpoint nor live
    shards fails, or with `if_nothing_to_resume="start_over"` starts over from step 0 in the same
    MLflow run (a driver started again by its command, killed before it had either: it was the run's
    start that was lost). A failed export (`export.saved_model`) is raised
    after the run is closed.

    This process imports TensorFlow only where it uses it (a model that must be imported to check
    its parameters, user hooks, a checkpoint's model part, a resume, an export; not the workers'
    and shards' tensors, which never pass through it), and then with every GPU hidden from it
    (tf_import.py): import TensorFlow before calling this to keep this process's GPUs.
    """
    from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
    from towerflow.checkpoint.stores import LocalCheckpointStore
    from towerflow.data.ingest import build_training_data
    from towerflow.data.reader_warmup import warm_reader_process
    from towerflow.runtime.cluster import (
        budget_for,
        check_actors_fit_nodes,
        ensure_ray,
        join_cluster,
        live_node_resources,
        runs_on_embedded_ray,
    )
    from towerflow.runtime.driver import Driver
    from towerflow.runtime.shard_count import resolve_shards
    from towerflow.runtime.worker_cpus import resolve_worker_cpus
    from towerflow.shared_types import DataFeed
    from towerflow.supervision import build_supervision_hooks
    from towerflow.supervision.artifacts import LocalArtifactSink, MlflowArtifactSink
    from towerflow.supervision.skipped_records import SkippedRecordsHook

    messages.show_unless_configured()  # a script's or notebook's caller sees what the CLI shows
    if not isinstance(spec, JobSpec):
        spec = load_spec(spec, overrides)
    # cluster.cpus_per_worker and cluster.ps: auto -> numbers, before anything sizes the cluster (a
    # cluster joined first, since its nodes size the workers); the shard count's estimate of a
    # worker's compute counts its CPUs.
    embedded = runs_on_embedded_ray()
    if not embedded:
        join_cluster()
    spec = resolve_shards(resolve_worker_cpus(spec, embedded))
    local_root = Path(output_dir or Path(os.environ.get("TOWERFLOW_RUNS_DIR", "runs")) / spec.name)
    tracker = None
    if track and resume == AUTO_RESUME:
        from towerflow.runtime.run_keeper import has_live_shards
        from towerflow.tracking.auto_resume import resumable_run
        from towerflow.tracking.store import run_store_uri

        resume = resumable_run(spec, run_store_uri(spec.tracking.tracking_uri), has_live_shards)
    elif resume == AUTO_RESUME:
        from towerflow.checkpoint.stores import latest_step

        has_checkpoint = latest_step(LocalCheckpointStore(local_root / "checkpoints")) is not None
        resume = str(local_root) if has_checkpoint else None
    if track:
        from towerflow.tracking import MLflowTracker

        tracker = MLflowTracker(spec, resume_run_id=resume, parent_run_id=parent_run_id)
        # A run with live shards needs no checkpoint (checked once Ray is reached, below).
        initial_state = tracker.restore_state(required=False) if resume else None

        def checkpoint_store(session: SessionInfo):
            return MlflowCheckpointStore(tracker.client, tracker.run_id)

        def artifact_sink(session: SessionInfo):
            return MlflowArtifactSink(tracker.client, tracker.run_id)
    else:
        from towerflow.checkpoint.resume import latest_checkpoint

        initial_state = (
            latest_checkpoint(LocalCheckpointStore(Path(resume) / "checkpoints"), resume) if resume else None
        )

        def checkpoint_store(session: SessionInfo):
            return LocalCheckpointStore(local_root / "checkpoints")

        def artifact_sink(session: SessionInfo):
            return LocalArtifactSink(local_root)

    ensure_ray(budget_for(spec.cluster), budget_for(spec.cluster, spec.cluster.fewest_workers))
    check_actors_fit_nodes(spec.cluster, live_node_resources())
    if tracker is not None and resume:
        # A lost driver's shards, still alive on this cluster: the run goes on from their state.
        from towerflow.runtime.run_keeper import take_over_live_run

        initial_state = take_over_live_run(resume, spec, stored=initial_state) or initial_state
        if initial_state is None and if_nothing_to_resume == "fail":
            tracker.restore_state()  # says that there is nothing to resume from
    skipped = SkippedRecordsHook() if spec.data.on_bad_record == "skip" else None
    # Hooks end in reverse order: the skipped-records hook comes right after the tracker, so that its
    # last counts reach the tracker before the tracker closes the run.
    all_hooks: list[Hook] = [hook for hook in (tracker, skipped) if hook is not None]
    all_hooks += build_supervision_hooks(spec, checkpoint_store=checkpoint_store, artifact_sink=artifact_sink)
    all_hooks.extend(hooks)

    def make_data(num_workers: int, examples_seen: int | None, shape: StepShape):
        seen = initial_state.examples_seen if initial_state is not None else 0
        seen = seen if examples_seen is None else examples_seen  # a rollback's checkpoint position
        ledger = skipped.ledger if skipped is not None else None
        data = build_training_data(
            spec, num_workers, shape, examples_seen=seen, ledger=ledger, check_nodes=examples_seen is None
        )
        if data.resume_note:
            log.info("%s", data.resume_note)
        if skipped is not None:
            skipped.ledger = data.ledger
        # A spare's node readies a process for the next pipeline's reads only where reads spread.
        ready = partial(warm_reader_process, data.reader) if data.reads_spread else None
        return DataFeed(data.splits, data.feature_scales, data.steps, ready, data.position)

    def latest_checkpoint():
        """The run's newest complete checkpoint (a lost shard rolls every shard back to it)."""
        from towerflow.checkpoint.stores import latest_step

        if tracker is not None:
            store = MlflowCheckpointStore(tracker.client, tracker.run_id)
        else:
            store = LocalCheckpointStore(local_root / "checkpoints")
        step = latest_step(store)
        return store.open(step) if step is not None else None

    driver = Driver(
        spec,
        all_hooks,
        make_data,
        faults=faults,
        initial_state=initial_state,
        latest_checkpoint=latest_checkpoint,
    )
    result = driver.run()
    if tracker is not None and tracker.end_error is not None:
        raise tracker.end_error
    return result
