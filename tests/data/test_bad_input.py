"""Bad input ends a real training job with one clear DataError naming the file (and record or line),
the MLflow run FAILED, and no hang; `on_bad_record: skip` trains on and logs what it skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO
from mlflow.tracking import MlflowClient
from support import (
    flip_byte,
    ray_actors,
    sqlite_store,
    tabular_header,
    tabular_rows,
    truncate,
    unstamped,
    write_csv,
    write_examples,
    write_uneven_shards,
)

from towerflow.errors import DataError
from towerflow.launch import train
from towerflow.spec import validate_spec

pytestmark = pytest.mark.timeout(300)  # never a hang


def _spec(tmp_path, paths, train_extra=None, input_dim=4, **data):
    return validate_spec(
        {
            "name": "bad-input",
            "model": {
                "ref": "models.mlp:build",
                "params": {"input_dim": input_dim, "num_classes": 2, "hidden": [8], "seed": 1},
                "from_logits": True,
            },
            "data": {
                "train": {"paths": paths, "label": "label", **(train_extra or {})},
                "batch_size": 16,
                "epochs": 1,
                "shuffle_files": False,
                **data,
            },
            "cluster": {"workers": 1, "ps": 1, "cpus_per_worker": 1, "cpus_per_ps": 0.5},
            "training": {"mode": "sync", "max_steps": 200},
            "tracking": {"tracking_uri": sqlite_store(tmp_path), "experiment": "bad-input"},
        }
    )


def _only_run(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("bad-input").experiment_id])
    return client, run


def _live(class_name: str) -> set[str]:
    return {a["ActorID"] for a in ray_actors(class_name) if a["State"] != "DEAD"}


def _live_soon_after(class_name: str, before: set[str], wait_s: float = 10.0) -> set[str]:
    """The actors of this class alive now that were not `before`, given `wait_s` to end (a kill
    reaches Ray's actor table moments after it is sent)."""
    deadline = time.monotonic() + wait_s
    while _live(class_name) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    return _live(class_name) - before


def _fails_with(tmp_path, spec, pattern):
    # Ray's table names the data's coordinator by Ray Data's class, which towerflow's extends.
    before = _live("SplitCoordinator")
    with pytest.raises(DataError, match=pattern) as failed:
        train(spec)
    # Its data coordinator's process has ended, though the error (whose traceback holds the run's
    # handles) is still held here, as a notebook holds the last one.
    assert not _live_soon_after("SplitCoordinator", before), failed.value
    _, run = _only_run(tmp_path)
    assert run.info.status == "FAILED"
    assert "towerflow.error" in run.data.tags
    return run


def _shards(tmp_path, sizes=(100, 100)):
    return write_uneven_shards(tmp_path / "data", list(sizes))


def test_empty_glob(ray_cluster, tmp_path):
    _fails_with(tmp_path, _spec(tmp_path, str(tmp_path / "none-*")), r"none-\*' matches no files")


def test_missing_listed_file(ray_cluster, tmp_path):
    good = _shards(tmp_path)
    spec = _spec(tmp_path, [str(good[0]), str(tmp_path / "data" / "gone")])
    _fails_with(tmp_path, spec, r"no such file .*data/gone")


def test_truncated_tfrecord(ray_cluster, tmp_path):
    paths = _shards(tmp_path)
    truncate(paths[1], 5)
    run = _fails_with(
        tmp_path, _spec(tmp_path, str(tmp_path / "data" / "train-*")), r"train-00001-of-00002: record 99"
    )
    assert "corrupt TFRecord" in run.data.tags["towerflow.error"]


def test_corrupt_crc(ray_cluster, tmp_path):
    paths = _shards(tmp_path)
    flip_byte(paths[0], os.path.getsize(paths[0]) // 2)
    _fails_with(
        tmp_path,
        _spec(tmp_path, str(tmp_path / "data" / "train-*")),
        r"train-00000-of-00002: record \d+: corrupt",
    )


# Each kind of bad record, read as a read task reads it, is tests/data/test_readers.py's; a run meets
# them all the same way, tested here once per format.
def test_a_run_reading_an_example_not_matching_the_spec_fails(ray_cluster, tmp_path):
    examples = [{"x": [0.5] * 4, "label": [i % 2], "example_id": [i]} for i in range(40)]
    examples[7].pop("x")
    path = write_examples(tmp_path / "data" / "train-00000-of-00001", examples)
    features = {
        "x": {"dtype": "float32", "shape": [4]},
        "label": {"dtype": "int64"},
        "example_id": {"dtype": "int64"},
    }
    spec = _spec(tmp_path, str(path), {"features": features})
    _fails_with(tmp_path, spec, r"train-00000-of-00001: record 7: .*Feature: x .*required")


def _csv_spec(tmp_path, **data):
    # Typed columns: inference would (rightly) call a column holding '1.2.3' a string column.
    features = {name: {"dtype": "float32" if name.startswith("f") else "int64"} for name in tabular_header()}
    train_extra = {"format": "csv", "groups": {"x": ["f*"]}, "features": features}
    return _spec(tmp_path, str(tmp_path / "csv" / "*.csv"), train_extra, input_dim=3, **data)


def test_a_run_reading_a_bad_csv_row_fails(ray_cluster, tmp_path):
    rows = tabular_rows(60)
    rows[10] = [rows[10][0], "1.2.3", *rows[10][2:]]
    write_csv(tmp_path / "csv" / "train-00000-of-00001.csv", tabular_header(), rows)
    message = r"line 12: column 'f0': '1.2.3' is not float32"
    _fails_with(tmp_path, _csv_spec(tmp_path), r"train-00000-of-00001\.csv: " + message)


def test_skip_trains_on_and_logs_what_it_skipped(ray_cluster, tmp_path):
    rows = tabular_rows(200)
    rows[3] = rows[3][:-1]
    rows[50] = [rows[50][0], "oops", *rows[50][2:]]
    write_csv(tmp_path / "csv" / "train-00000-of-00002.csv", tabular_header(), rows[:100])
    write_csv(tmp_path / "csv" / "train-00001-of-00002.csv", tabular_header(), rows[100:])
    spec = _csv_spec(tmp_path, on_bad_record="skip", drop_remainder=False, epochs=2)
    ledgers = {a["ActorID"] for a in ray_actors("SkippedRecordsLedger")}
    result = train(spec)
    assert result.examples_seen == 2 * 198
    assert len({a["ActorID"] for a in ray_actors("SkippedRecordsLedger")} - ledgers) == 1  # the run's one
    assert not _live_soon_after("SkippedRecordsLedger", ledgers)  # and it ended with the run
    # Counted per file, not per read: the second epoch finds the same two records again.
    client, run = _only_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["bad_records_skipped"] == 2
    assert run.data.metrics["bad_records_skipped/train-00000-of-00002.csv"] == 2


def test_cli_exits_non_zero_with_one_paragraph(ray_cluster, tmp_path):
    paths = _shards(tmp_path)
    truncate(paths[0], 3)
    spec = _spec(tmp_path, str(tmp_path / "data" / "train-*"))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_unset=False)))
    out = subprocess.run(
        [sys.executable, "-m", "towerflow", "train", str(job), "--no-progress"],
        cwd=REPO,
        env={
            **os.environ,
            "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
            "RAY_AUTH_MODE": "token",
        },
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 2, out.stderr
    ours = [line for line in unstamped(out.stderr) if "pid=" not in line]  # not forwarded actor logs
    errors = [line for line in ours if line.startswith("towerflow: error:")]
    assert len(errors) == 1 and "train-00000-of-00002: record 99: corrupt TFRecord" in errors[0], out.stderr
    assert unstamped(out.stderr.rstrip())[-1] == errors[0], (
        "the error is the last word, after any actor's log"
    )
    # Ray Data's own coordinator logs its task's traceback; with log_to_driver those lines carry "pid=".
    assert not any("Traceback" in line for line in ours)
    _, run = _only_run(tmp_path)
    assert run.info.status == "FAILED"
