"""The MLflow seam: params, step metrics (step = global_step) and run status in a real store."""

from __future__ import annotations

import json
import logging
import subprocess

import keras
import pytest
import ray
import tensorflow as tf
from mlflow.tracking import MlflowClient
from support import ONE_OF_EACH, blob_spec, sqlite_store, tracked_spec

from towerflow.errors import DataError
from towerflow.launch import train
from towerflow.spec import validate_spec
from towerflow.tracking import default_tracking_uri
from towerflow.tracking.run_metadata import git_state
from towerflow.tracking.store import RAY_JOB_ENV, run_store_uri


def test_default_store_is_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_tracking_uri(workdir=tmp_path) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert default_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert default_tracking_uri() == "sqlite:///elsewhere.db"


def test_a_store_lost_with_a_ray_jobs_working_directory_is_warned_of_once(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # as Ray runs a job: in the working directory it unpacked for it
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv(RAY_JOB_ENV, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0.zip"}}))
    assert run_store_uri() == run_store_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "MLFLOW_TRACKING_URI" in warnings[0], warnings
    caplog.clear()
    assert run_store_uri("sqlite:///kept.db") == "sqlite:///kept.db"  # a store of the spec's own
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    run_store_uri()
    monkeypatch.setenv(RAY_JOB_ENV, json.dumps({"runtime_env": {}}))  # a job run where it was started
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    run_store_uri()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_run_records_spec_and_step_metrics(ray_cluster, blob_data, tmp_path):
    spec, uri = tracked_spec(
        tmp_path,
        blob_data,
        "t",
        cluster=ONE_OF_EACH,
        training={"max_steps": 8},
        supervision={"log_every_steps": 3},
    )
    result = train(spec)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["training.optimizer.name"] == "sgd"
    assert run.data.params["model.ref"] == "models.mlp:build"
    assert run.data.tags["mode"] == "sync" and "ray.version" in run.data.tags
    history = client.get_metric_history(result.run_id, "loss")
    assert [m.step for m in history] == [1, 4, 7, 8]  # the first, every 3rd, and the last
    assert run.info.artifact_uri.startswith((tmp_path / "mlruns").as_uri())
    steps = client.get_metric_history(result.run_id, "global_step")
    assert all(m.step == m.value for m in steps)
    assert "train_accuracy" in run.data.metrics and "time_compute_s" in run.data.metrics
    # No rate is known at step 1 (one step ended): the chart starts with a measured one, not 0.
    rates = client.get_metric_history(result.run_id, "examples_per_sec")
    assert [m.step for m in rates] == [4, 7, 8] and all(m.value > 0 for m in rates), rates


def test_run_records_versions_cluster_shape_and_git_commit(ray_cluster, blob_data, tmp_path):
    cluster = {"workers": 1, "ps": 2}  # two different numbers, so neither can stand for the other
    spec, uri = tracked_spec(tmp_path, blob_data, "meta", cluster=cluster, training={"max_steps": 2})
    run = MlflowClient(uri).get_run(train(spec).run_id)
    params, tags = run.data.params, run.data.tags
    assert params["versions.tensorflow"] == tags["tensorflow.version"] == tf.__version__
    assert params["versions.keras"] == tags["keras.version"] == keras.__version__
    assert params["versions.ray"] == tags["ray.version"] == ray.__version__
    for name in ("towerflow", "mlflow", "python"):
        assert params[f"versions.{name}"] == tags[f"{name}.version"]
    resources = ray.cluster_resources()
    assert (
        params["cluster.cpus"] == f"{resources['CPU']:g}"
        and params["cluster.gpus"] == f"{resources.get('GPU', 0):g}"
    )
    assert params["cluster.nodes"] == str(len([n for n in ray.nodes() if n["Alive"]]))
    assert params["cluster.workers"] == "1" and params["cluster.ps_shards"] == "2"
    # The tests run from the repository root, a git work tree: the run names its commit.
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == tags["towerflow.git.commit"] == head
    assert tags["towerflow.git.dirty"] in ("true", "false")


def test_git_state_outside_a_repository_and_of_a_dirty_one(tmp_path):
    assert git_state(tmp_path) == {}
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q", "-b", "main", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("one")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.txt"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "one"], check=True)
    clean = git_state(tmp_path)
    assert len(clean["commit"]) == 40 and clean["dirty"] == "false" and clean["branch"] == "main"
    (tmp_path / "a.txt").write_text("two")
    assert git_state(tmp_path) == {**clean, "dirty": "true"}


def test_failed_run_is_marked_failed(ray_cluster, blob_data, tmp_path):
    uri = sqlite_store(tmp_path)
    raw = blob_spec(blob_data, tracking={"tracking_uri": uri, "experiment": "bad"})
    raw["data"]["train"]["label"] = "no_such_label"
    with pytest.raises(DataError, match="no_such_label"):
        train(validate_spec(raw))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("bad").experiment_id])
    assert run.info.status == "FAILED"
    assert "no_such_label" in run.data.tags["towerflow.error"]


def test_step_window_figures():
    from towerflow.runtime.hooks import StepEvent
    from towerflow.tracking.step_metrics import StepWindow

    def event(step, elapsed, workers, staleness=()):
        return StepEvent(
            step, 0.5, {}, 32 * len(workers), 0, elapsed, 0.0, {}, workers, staleness=list(staleness)
        )

    window = StepWindow()
    window.add(event(1, 1.0, [0, 1]))
    window.add(event(2, 2.0, [0], [0]))
    window.add(event(3, 3.0, [1], [3]))
    figures = window.metrics()
    assert figures["global_step_per_sec"] == pytest.approx(1.0)
    assert figures["worker_0_examples_per_sec"] == pytest.approx(16.0)  # step 1 opens the window
    assert figures["staleness_max"] == 3 and figures["staleness_p50"] == pytest.approx(1.5)
    window.add(event(5, 5.0, [0, 1], [1, 1]))
    assert window.metrics()["global_step_per_sec"] == pytest.approx(1.0)  # measured from step 3


def test_a_lost_drivers_past_steps_are_logged_after_what_it_logged_at_the_runs_cadence(blob_data, tmp_path):
    """A new driver that took a run over hears of the lost one's last steps from its workers
    (`on_past_steps`): those past the run's last logged step are logged every `log_every_steps`,
    and the new driver's own steps go on at that cadence: the run's metrics have no gap."""
    from towerflow.runtime.hooks import RunContext, RunOutcome, SessionInfo, StepEvent
    from towerflow.tracking import MLflowTracker

    uri = sqlite_store(tmp_path)
    tracking = {"tracking_uri": uri, "experiment": "past"}
    spec = validate_spec(blob_spec(blob_data, tracking=tracking, supervision={"log_every_steps": 5}))

    def event(step: int) -> StepEvent:
        return StepEvent(step, 1.0 / step, {"accuracy": 0.5}, 32, 32 * step, float(step), 100.0, {}, [0])

    lost = MLflowTracker(spec)
    lost.begin(SessionInfo(spec=spec, num_workers=1, num_shards=1))
    for step in (1, 5, 10):  # what the lost driver logged, its run left RUNNING
        lost.client.log_metric(lost.run_id, "loss", 1.0 / step, step=step)
        lost.client.log_metric(lost.run_id, "global_step", step, step=step)
    taker = MLflowTracker(spec, resume_run_id=lost.run_id)
    session = SessionInfo(
        spec=spec, num_workers=1, num_shards=1, start_step=23, resumed_from="its live shards"
    )
    taker.begin(session)
    taker.on_past_steps([event(step) for step in range(8, 24)])
    for step in range(24, 31):
        taker.after_run(RunContext(session), event(step))
    taker.end(session, RunOutcome("FINISHED", 30))
    history = taker.client.get_metric_history(lost.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 5, 10, 15, 20, 25, 30]
    past = {m.step: m.value for m in taker.client.get_metric_history(lost.run_id, "train_accuracy")}
    assert past[15] == 0.5 and 15 not in {
        m.step for m in taker.client.get_metric_history(lost.run_id, "elapsed_s")
    }


def test_a_run_whose_begin_fails_once_it_is_open_ends_failed_not_running(blob_data, tmp_path):
    """The artifact store refuses the spec artifact after the run was created: the driver ends only
    the hooks that began, so the tracker ends its run itself, FAILED with the error."""
    from mlflow.tracking import MlflowClient

    from towerflow.runtime.hooks import SessionInfo
    from towerflow.tracking import MLflowTracker

    uri = sqlite_store(tmp_path)
    not_a_folder = tmp_path / "artifacts"
    not_a_folder.write_text("a file where the artifacts would go")
    MlflowClient(uri).create_experiment("refused", artifact_location=not_a_folder.as_uri())
    spec = validate_spec(blob_spec(blob_data, tracking={"tracking_uri": uri, "experiment": "refused"}))
    tracker = MLflowTracker(spec)
    with pytest.raises(OSError):  # the artifact store cannot make its folder
        tracker.begin(SessionInfo(spec=spec, num_workers=1, num_shards=1))
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["towerflow.error"]


def test_a_driver_woken_after_its_run_ended_without_it_ends_the_run_failed_unless_another_has_it(
    blob_data, tmp_path
):
    """A driver paused past driver_grace_s wakes to find its run's control point ended
    (RunEndedWhileAway): with no other driver on the run, it ends the MLflow run FAILED with why,
    not RUNNING for ever; where another driver has reopened the run since, it leaves it. A driver
    taken over (RunTakenOver) leaves the run in either case."""
    from towerflow.errors import RunEndedWhileAway, RunTakenOver
    from towerflow.runtime.hooks import RunContext, RunOutcome, SessionInfo, StepEvent
    from towerflow.tracking import MLflowTracker

    uri = sqlite_store(tmp_path)
    spec = validate_spec(blob_spec(blob_data, tracking={"tracking_uri": uri, "experiment": "away"}))
    away = RunEndedWhileAway("run r's control point has ended")

    def paused_driver() -> tuple[MLflowTracker, SessionInfo]:
        tracker, session = MLflowTracker(spec), SessionInfo(spec=spec, num_workers=1, num_shards=1)
        tracker.begin(session)
        tracker.after_run(RunContext(session), StepEvent(1, 0.5, {}, 32, 32, 1.0, 100.0, {}, [0]))
        return tracker, session

    alone, session = paused_driver()
    alone.end(session, RunOutcome("TAKEN_OVER", 1, away))
    run = alone.client.get_run(alone.run_id)
    assert run.info.status == "FAILED" and "control point has ended" in run.data.tags["towerflow.error"]
    assert [m.step for m in alone.client.get_metric_history(alone.run_id, "loss")] == [1]

    for error in (RunTakenOver("taken over"), away):
        left, session = paused_driver()
        resumed = MLflowTracker(spec, resume_run_id=left.run_id)
        resumed.begin(SessionInfo(spec=spec, num_workers=1, num_shards=1, resumed_from="a checkpoint"))
        left.end(session, RunOutcome("TAKEN_OVER", 1, error))
        run = left.client.get_run(left.run_id)
        assert run.info.status == "RUNNING" and "towerflow.error" not in run.data.tags, error


def test_a_run_stopped_again_while_it_ends_ends_killed_not_running(blob_data, tmp_path):
    """Ctrl-C while the tracker ends the run (here in the export's model build, seconds long): the
    run ends KILLED at once, not RUNNING for ever; the interrupt goes on to the CLI."""
    import types

    from towerflow.runtime.hooks import RunOutcome, SessionInfo
    from towerflow.tracking import MLflowTracker

    uri = sqlite_store(tmp_path)
    raw = blob_spec(
        blob_data, tracking={"tracking_uri": uri, "experiment": "again"}, export={"saved_model": True}
    )
    raw["model"]["ref"] = "tests.runtime.model_fns:stopped_while_built"
    spec = validate_spec(raw)
    tracker, session = MLflowTracker(spec), SessionInfo(spec=spec, num_workers=1, num_shards=1)
    tracker.begin(session)
    with pytest.raises(KeyboardInterrupt):
        tracker.end(
            session, RunOutcome("FINISHED", 10, result=types.SimpleNamespace(parameters=[], model_state=None))
        )
    assert tracker.client.get_run(tracker.run_id).info.status == "KILLED"
