"""`towerflow compare`: sync and async as child runs of one parent run, with PNG plots in the parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient
from support import blob_spec, sqlite_store, tracked_spec

from towerflow.compare import compare_modes, parse_modes, spec_for_mode
from towerflow.errors import DataError, SpecError
from towerflow.spec import validate_spec
from towerflow.tracking.store import RAY_JOB_ENV


def test_both_modes_become_child_runs_with_plots_in_the_parent(ray_cluster, blob_data, tmp_path):
    spec, uri = tracked_spec(
        tmp_path,
        blob_data,
        "cmp",
        cluster={"workers": 2, "ps": 1},  # two workers, so that sync and async differ
        training={"max_steps": 5},
        supervision={"log_every_steps": 1},  # a point per step for the plots
    )
    comparison = compare_modes(spec, ["sync", "async"])
    client = MlflowClient(uri)
    parent = client.get_run(comparison.parent_run_id)
    assert comparison.experiment_id == parent.info.experiment_id  # the page the command prints
    # Artifacts live beside the SQLite store, not in the working directory.
    assert (
        client.get_experiment(parent.info.experiment_id).artifact_location == (tmp_path / "mlruns").as_uri()
    )
    assert parent.info.status == "FINISHED" and parent.data.tags["towerflow.compare.modes"] == "sync,async"
    for mode in ("sync", "async"):
        child = client.get_run(comparison.results[mode].run_id)
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["mode"] == child.data.params["training.mode"] == mode
        assert child.data.tags["mlflow.runName"] == f"blobs-test-{mode}"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "elapsed_s")] == [1, 2, 3, 4, 5]
        assert f"{mode}.final_loss" in parent.data.metrics
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id, "plots")) == [
        "plots/loss_vs_examples_seen.png",
        "plots/loss_vs_wall_time.png",
    ]
    for name in comparison.plots:
        local = mlflow.artifacts.download_artifacts(
            run_id=parent.info.run_id, artifact_path=name, tracking_uri=uri
        )
        image = matplotlib.image.imread(local)  # a real PNG with drawn content, not an empty canvas
        assert image.shape[:2] == (450, 700) and image.std() > 0.05


def test_modes_are_checked_before_anything_runs(blob_data):
    assert parse_modes("sync, async") == ["sync", "async"]
    for bad in ("sync,bogus", "", "sync,sync"):
        with pytest.raises(SpecError, match="--modes"):
            parse_modes(bad)
    spec = validate_spec(
        blob_spec(
            blob_data,
            training={"mode": "async", "max_staleness": 2, "fetch_every": 2, "overlap_push": True},
        )
    )
    sync = spec_for_mode(spec, "sync")  # the async-only staleness bound is dropped for the sync child
    assert (
        sync.training.mode == "sync"
        and sync.training.max_staleness is None
        and sync.training.fetch_every == 1
        and not sync.training.overlap_push
    )
    assert spec_for_mode(spec, "async").training.max_staleness == 2
    assert spec_for_mode(spec, "async").training.fetch_every == 2
    assert spec_for_mode(spec, "async").training.overlap_push
    exporting = validate_spec(blob_spec(blob_data, export={"saved_model": True, "register_as": "m"}))
    assert not spec_for_mode(exporting, "sync").export.saved_model  # children export nothing by default
    assert spec_for_mode(exporting, "sync", ["export.saved_model=true"]).export.saved_model


def test_cli_rejects_unknown_modes_with_one_paragraph(tmp_path):
    spec = Path(__file__).resolve().parents[2] / "pipelines" / "mnist_sync.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "towerflow", "compare", str(spec), "--modes", "sync,downpour"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--modes 'sync,downpour'" in done.stderr and "Traceback" not in done.stderr


def test_a_compare_job_on_the_default_store_is_warned_that_it_loses_its_runs(ray_cluster, tmp_path):
    # A Ray job runs in a copy of its working directory (here tmp_path), so the default store would go
    # with it. The data is missing too, so the job ends early, as a user would see it.
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(blob_spec(tmp_path / "nowhere")))
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
        RAY_JOB_ENV: json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0.zip"}}),
        "PYTHONPATH": str(repo),  # models/, as the job's working directory would hold it
    }
    done = subprocess.run(
        # an async-only setting, which the comparison keeps for its async run alone
        [sys.executable, "-m", "towerflow", "compare", str(spec), "--no-progress"]
        + ["--set", "training.max_staleness=4"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "towerflow: warning:" in line]
    assert len(warnings) == 1 and f"{tmp_path / 'mlflow.db'}" in warnings[0], done.stderr
    assert "matches no files" in done.stderr


def test_a_failed_child_fails_the_parent(ray_cluster, blob_data, tmp_path):
    uri = sqlite_store(tmp_path)
    raw = blob_spec(blob_data, tracking={"tracking_uri": uri, "experiment": "cmp-bad"})
    raw["data"]["train"]["label"] = "no_such_label"
    with pytest.raises(DataError, match="no_such_label"):
        compare_modes(validate_spec(raw), ["sync", "async"])
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("cmp-bad").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("mode") == "compare")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FAILED"
    assert [c.data.tags["mode"] for c in children] == ["sync"] and children[0].info.status == "FAILED"
