"""`--resume auto`'s choice (tracking/auto_resume.py) on a real MLflow store: which run of a job
goes on, and what happens to a run whose driver died before its first checkpoint."""

from __future__ import annotations

import numpy as np
from mlflow.tracking import MlflowClient
from support import blob_spec, sqlite_store

from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.checkpoint.state import TrainingState
from towerflow.spec import validate_spec
from towerflow.tracking.auto_resume import resumable_run


def _job(tmp_path, blob_data):
    uri = sqlite_store(tmp_path)
    spec = validate_spec(blob_spec(blob_data, tracking={"tracking_uri": uri, "experiment": "resume-auto"}))
    client = MlflowClient(uri)
    experiment = client.create_experiment("resume-auto", artifact_location=str(tmp_path / "artifacts"))
    return spec, uri, client, experiment


def _run(client, experiment, job: str, status: str | None = None, **tags: str) -> str:
    run = client.create_run(experiment, tags={"towerflow.job": job, **tags})
    if status is not None:
        client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def test_the_newest_unfinished_run_with_a_checkpoint_goes_on(tmp_path, blob_data):
    spec, uri, client, experiment = _job(tmp_path, blob_data)
    _run(client, experiment, spec.name, "FINISHED")
    killed = _run(client, experiment, spec.name, "KILLED")
    state = TrainingState(7, "sgd", ["w"], {"w": np.ones(3, np.float32)}, {}, {"examples_seen": 70})
    MlflowCheckpointStore(client, killed).save(state)
    _run(client, experiment, "another-job")  # another job's run is never taken
    assert resumable_run(spec, uri) == killed


def test_a_comparisons_runs_are_never_taken(tmp_path, blob_data):
    """`towerflow compare` stopped in its async child: that child (another mode, under its parent)
    and the parent are the job's newest runs, but the job's own run goes on."""
    spec, uri, client, experiment = _job(tmp_path, blob_data)
    state = TrainingState(7, "sgd", ["w"], {"w": np.ones(3, np.float32)}, {}, {"examples_seen": 70})
    own = _run(client, experiment, spec.name, "KILLED", mode="sync")
    MlflowCheckpointStore(client, own).save(state)
    parent = _run(client, experiment, spec.name, "KILLED", mode="compare")
    child = _run(client, experiment, spec.name, "KILLED", mode="async", **{"mlflow.parentRunId": parent})
    MlflowCheckpointStore(client, child).save(state)
    assert resumable_run(spec, uri) == own


def test_a_finished_newest_run_means_a_new_run(tmp_path, blob_data):
    spec, uri, client, experiment = _job(tmp_path, blob_data)
    _run(client, experiment, spec.name, "FINISHED")
    assert resumable_run(spec, uri) is None


def test_a_running_run_that_left_no_checkpoint_is_ended_failed_and_a_new_one_starts(tmp_path, blob_data):
    spec, uri, client, experiment = _job(tmp_path, blob_data)
    orphan = _run(client, experiment, spec.name)  # RUNNING: its driver was SIGKILLed early
    assert resumable_run(spec, uri) is None
    run = client.get_run(orphan)
    assert run.info.status == "FAILED"  # not RUNNING for ever
    assert "before its first checkpoint" in run.data.tags["towerflow.ended_by"]


def test_a_running_run_with_no_checkpoint_but_live_shards_goes_on(tmp_path, blob_data):
    spec, uri, client, experiment = _job(tmp_path, blob_data)
    lost = _run(client, experiment, spec.name)  # RUNNING: its driver lost, its shards kept alive
    assert resumable_run(spec, uri, has_live_shards=lambda run_id: run_id == lost) == lost
    assert client.get_run(lost).info.status == "RUNNING"


def test_a_store_that_does_not_answer_is_said_so_not_taken_for_no_run(tmp_path, blob_data, monkeypatch):
    """A tracking server away (or refusing the credentials) as a command starts: a ClusterError
    that names the store without its credentials, for `--resume auto` and `--resume RUN_ID`
    alike; not a traceback, nor "no such run"."""
    import socket

    import pytest

    from towerflow.errors import ClusterError
    from towerflow.runtime.hooks import SessionInfo
    from towerflow.tracking import MLflowTracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    uri = f"http://alice:secret@127.0.0.1:{port}"
    spec = validate_spec(blob_spec(blob_data, tracking={"tracking_uri": uri, "experiment": "away"}))
    with pytest.raises(
        ClusterError, match=rf"MLflow store http://127\.0\.0\.1:{port} could not be read"
    ) as auto:
        resumable_run(spec, uri)
    tracker = MLflowTracker(spec, resume_run_id="0" * 32)
    with pytest.raises(ClusterError, match=f"--resume {'0' * 32}: the MLflow store") as given:
        tracker.begin(SessionInfo(spec=spec, num_workers=1, num_shards=1))
    assert "secret" not in str(auto.value) + str(given.value)
