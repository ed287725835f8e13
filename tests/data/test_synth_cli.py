"""`towerflow data synth` as a user runs it: real subprocesses, files, exit codes and messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


def _synth(*args):
    return subprocess.run(
        [sys.executable, "-m", "towerflow", "data", "synth", *args],
        cwd=REPO,
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tabular_csv_with_imbalance(tmp_path):
    out = _synth(
        "tabular", "--out", str(tmp_path), "--shards", "3", "--examples", "300",
        "--eval-examples", "60", "--format", "csv", "--imbalance", "0.2", "--seed", "5",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "wrote tabular (csv)" in out.stdout and "train: 300 examples in 3 files" in out.stdout
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["seed"] == 5 and manifest["imbalance"] == 0.2 and manifest["format"] == "csv"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["manifest.json", "eval-00000-of-00001.csv"] + [f"train-{i:05d}-of-00003.csv" for i in range(3)]
    )


def test_ptb_tfrecord_with_a_small_vocabulary(tmp_path):
    out = _synth("ptb", "--out", str(tmp_path), "--shards", "2", "--examples", "40", "--eval-examples", "0",
                 "--vocab-size", "50")  # fmt: skip
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["vocab_size"] == 50 and list(manifest["splits"]) == ["train"]
    assert len((tmp_path / "vocab.txt").read_text().splitlines()) == 50


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shards", "0"], "got 60000 examples for 0 shards"),
        (["--shards", "4", "--examples", "3"], "got 3 examples for 4 shards"),
        (["--eval-shards", "3", "--eval-examples", "2"], "synthetic eval split"),
        (["--imbalance", "0.2"], "--imbalance applies to `data synth tabular` only"),
        (["--vocab-size", "100"], "--vocab-size applies to `data synth ptb` only"),
        (["--seed", "-1"], "seed must be a non-negative integer"),
        (["--format", "parquet"], "invalid choice: 'parquet'"),
    ],
)
def test_bad_arguments_exit_2_with_one_message(tmp_path, args, message):
    out = _synth("mnist", "--out", str(tmp_path / "d"), *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_an_out_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    out = _synth("mnist", "--out", str(tmp_path / "a-file" / "d"), "--examples", "10", "--eval-examples", "0")
    assert out.returncode == 2
    assert (
        f"--out {tmp_path / 'a-file' / 'd'}: cannot write" in out.stderr and "Not a directory" in out.stderr
    )
    assert "Traceback" not in out.stderr
