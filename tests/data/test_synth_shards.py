"""The shared shard writer: planned sizes, both formats, stale files, and misuse caught."""

from __future__ import annotations

import numpy as np
import pytest

from towerflow.data.synth import synth_tabular
from towerflow.data.synth.shards import SplitWriter, check_plan, shard_names, shard_sizes
from towerflow.errors import SpecError

FEATURES = {"example_id": {"dtype": "int64", "shape": []}, "x": {"dtype": "float32", "shape": []}}


def test_sizes_and_names():
    assert shard_sizes(10, 4) == [3, 3, 2, 2] and sum(shard_sizes(60000, 7)) == 60000
    assert shard_names("eval", 2) == ["eval-00000-of-00002", "eval-00001-of-00002"]
    assert shard_names("train", 1, "csv") == ["train-00000-of-00001.csv"]


@pytest.mark.parametrize(
    "fmt, plan, match",
    [
        ("parquet", {"train": (10, 1)}, "unknown format 'parquet'"),
        ("csv", {"train": (10, 0)}, "got 10 examples for 0 shards"),
        ("csv", {"train": (10, 2), "eval": (1, 2)}, "synthetic eval split"),
    ],
)
def test_plans_that_cannot_be_written_are_refused(fmt, plan, match):
    with pytest.raises(SpecError, match=match):
        check_plan(fmt, plan)


def test_chunks_are_cut_across_shard_boundaries(tmp_path):
    writer = SplitWriter(tmp_path, "train", [4, 3, 3], "csv", FEATURES)
    for start, stop in ((0, 5), (5, 6), (6, 10)):
        writer.write(
            {"example_id": np.arange(start, stop), "x": np.arange(start, stop, dtype=np.float32) / 4}
        )
    writer.close()
    lines = [(tmp_path / name).read_text().splitlines() for name in writer.files]
    assert [len(f) - 1 for f in lines] == [4, 3, 3]
    assert lines[0][0] == "example_id,x" and lines[1][1:] == ["4,1", "5,1.25", "6,1.5"]


def test_writing_more_or_fewer_examples_than_planned_is_a_bug_caught(tmp_path):
    writer = SplitWriter(tmp_path, "train", [2], "csv", FEATURES)
    with pytest.raises(RuntimeError, match="more examples"):
        writer.write({"example_id": np.arange(3), "x": np.zeros(3, np.float32)})
    short = SplitWriter(tmp_path, "eval", [2, 2], "csv", FEATURES)
    short.write({"example_id": np.arange(3), "x": np.zeros(3, np.float32)})
    with pytest.raises(RuntimeError, match="fewer examples"):
        short.close()


def test_rewriting_in_another_format_leaves_only_the_new_shards(tmp_path):
    synth_tabular(tmp_path, shards=3, examples=30, eval_examples=10, fmt="tfrecord")
    (tmp_path / "notes.txt").write_text("kept")
    synth_tabular(tmp_path, shards=2, examples=30, eval_examples=0, fmt="csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest.json",
        "notes.txt",
        "train-00000-of-00002.csv",
        "train-00001-of-00002.csv",
    ]
