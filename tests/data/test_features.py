"""Feature specs without Ray: groups, inference, varlen on the worker side, other filesystems."""

from __future__ import annotations

import fsspec
import numpy as np
import pytest
import tensorflow as tf
from support import example_bytes, flip_byte, tabular_header, tabular_rows, write_csv, write_examples

from towerflow.data.csv import CsvLayout, read_csv_file
from towerflow.data.features import ColumnPlan, expand_groups, normalize
from towerflow.data.infer import infer_csv, infer_tfrecord
from towerflow.data.sources import resolve_files
from towerflow.data.tfrecord import ragged_column, read_tfrecord_file
from towerflow.errors import DataError
from towerflow.runtime.batches import BatchAdapter

FEATURES = normalize(
    {
        "f1": {"dtype": "float32"},
        "f0": {"dtype": "float32", "shape": [2]},
        "img": {"dtype": "bytes", "decode": "uint8", "decoded_shape": [2], "scale": 0.5},
        "name": {"dtype": "bytes"},
        "label": {"dtype": "int64"},
        "example_id": {"dtype": "int64"},
    },
    origin="test",
)


def test_groups_expand_in_sorted_order_and_concatenate_as_float32():
    groups = expand_groups({"x": ["f*", "img"]}, FEATURES, "label")
    assert groups == {"x": ["f0", "f1", "img"]}
    plan = ColumnPlan(FEATURES, groups)
    out = plan(
        {
            "f0": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
            "f1": np.array([5.0, 6.0], np.float32),
            "img": np.array([[2, 4], [6, 8]], np.uint8),
            "label": np.array([0, 1]),
        }
    )
    assert set(out) == {"x", "label"}
    np.testing.assert_array_equal(out["x"], [[1, 2, 5, 1, 2], [3, 4, 6, 3, 4]])  # img scaled by 0.5
    assert out["x"].dtype == np.float32


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ({"x": ["g*"]}, "matches no feature"),
        ({"x": ["f0"], "y": ["f*"]}, "'f0' is in both 'x' and 'y'"),
        ({"x": ["label", "f0"]}, "the label or an id"),
        ({"x": ["name"]}, "holds bytes"),
        ({"f1": ["f0"]}, "already a feature's name"),
    ],
)
def test_bad_groups_are_named(groups, message):
    with pytest.raises(DataError, match=message):
        expand_groups(groups, FEATURES, "label")


def test_infer_tfrecord_shapes_dtypes_and_varlen(tmp_path):
    records = [
        {"x": [0.5, 1.5], "ids": list(range(i % 3 + 1)), "raw": [b"ab"], "label": [1]} for i in range(5)
    ]
    found = infer_tfrecord(str(write_examples(tmp_path / "a", records)))
    assert found == {
        "ids": {"dtype": "int64", "shape": [], "varlen": True},
        "label": {"dtype": "int64", "shape": []},
        "raw": {"dtype": "bytes", "shape": []},
        "x": {"dtype": "float32", "shape": [2]},
    }


def test_infer_tfrecord_goes_by_the_records_before_a_corrupt_one(tmp_path):
    """The reads judge a corrupt record as data.on_bad_record says: inference failed on it, also
    where the run would have skipped it; with no record before it there is nothing to infer from."""
    path = write_examples(tmp_path / "a", [{"x": [0.5, 1.5], "label": [i % 2]} for i in range(10)])
    size = path.stat().st_size // 10
    flip_byte(path, 6 * size + 20)  # inside record 6's data
    assert infer_tfrecord(str(path)) == {
        "label": {"dtype": "int64", "shape": []},
        "x": {"dtype": "float32", "shape": [2]},
    }
    flip_byte(path, 20)  # record 0's too
    with pytest.raises(DataError, match=r"/a: record 0: corrupt TFRecord"):
        infer_tfrecord(str(path))


def test_infer_csv_types(tmp_path):
    rows = [[i, repr(i / 3), f"c{i}", i % 2] for i in range(5)]
    path = write_csv(tmp_path / "a.csv", ["example_id", "f0", "city", "label"], rows)
    assert infer_csv(str(path), CsvLayout()) == {
        "example_id": {"dtype": "int64", "shape": []},
        "f0": {"dtype": "float32", "shape": []},
        "city": {"dtype": "bytes", "shape": []},
        "label": {"dtype": "int64", "shape": []},
    }


def test_varlen_pads_to_the_batch_longest_or_goes_ragged_on_the_worker():
    column = ragged_column(np.array([1, 2, 3, 4, 5, 6]), np.array([0, 1, 1, 4, 6]))
    padded = BatchAdapter(["ids"], "label", varlen={"ids": {"ragged": False, "default": -1}})
    inputs, _ = padded({"ids": column, "label": np.zeros(4)})
    assert inputs.tolist() == [[1, -1, -1], [-1, -1, -1], [2, 3, 4], [5, 6, -1]]
    ragged = BatchAdapter(["ids"], "label", varlen={"ids": {"ragged": True, "default": None}})
    inputs, _ = ragged({"ids": column, "label": np.zeros(4)})
    assert isinstance(inputs, tf.RaggedTensor) and inputs.to_list() == [[1], [], [2, 3, 4], [5, 6]]


def test_dict_inputs_by_name_without_label_or_id():
    adapter = BatchAdapter(["a", "b"], "label")
    batch = {"a": np.ones(2), "b": np.zeros(2), "label": np.array([0, 1]), "example_id": np.array([4, 5])}
    inputs, labels = adapter(batch)
    assert set(inputs) == {"a", "b"} and labels.tolist() == [0, 1]
    single = BatchAdapter(["pixels"], "label")  # one input, one feature left: taken whatever its name
    inputs, _ = single({"image": np.ones(2), "label": np.array([0, 1]), "example_id": np.array([4, 5])})
    assert inputs.tolist() == [1.0, 1.0]
    with pytest.raises(DataError, match=r"input\(s\) \['c'\] have no matching feature"):
        BatchAdapter(["a", "c"], "label")(batch)


def test_sources_on_another_filesystem():
    """fsspec's in-memory filesystem stands in for s3:// and friends: globbing, CSV and TFRecord reads."""
    fs = fsspec.filesystem("memory")
    rows = tabular_rows(5)
    fs.pipe(
        "/bucket/csv/train-00000-of-00001.csv",
        ("\n".join(",".join(map(str, r)) for r in [tabular_header(), *rows]) + "\n").encode(),
    )
    record = example_bytes({"x": [1.0], "label": [0]})
    framed = _frame(record)
    fs.pipe("/bucket/tfr/train-00000-of-00001", framed * 3)
    (csv_file,) = resolve_files(["memory://bucket/csv/*.csv"])
    assert csv_file.startswith("memory://") and csv_file.endswith("/bucket/csv/train-00000-of-00001.csv")
    features = normalize(
        {n: {"dtype": "float32" if n.startswith("f") else "int64"} for n in tabular_header()}, origin="t"
    )
    (batch,) = read_csv_file(csv_file, CsvLayout(), features)
    assert batch["example_id"].tolist() == list(range(5))
    (files,) = [resolve_files(["memory://bucket/tfr/train-*"])]
    (batch,) = read_tfrecord_file(
        files[0], normalize({"x": {"dtype": "float32"}, "label": {"dtype": "int64"}}, origin="t")
    )
    assert batch["x"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(DataError, match="matches no files"):
        resolve_files(["memory://bucket/none-*"])


def _frame(record: bytes) -> bytes:
    """One TFRecord frame, written by TensorFlow's own writer (so the CRCs are right)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "one"
        with tf.io.TFRecordWriter(str(path)) as writer:
            writer.write(record)
        return path.read_bytes()


def test_several_label_columns_grouped_into_one_label(ray_cluster, tmp_path):
    """CSV with two target columns: `groups: {y: [t*]}` and `label: y` train a two-output regression."""
    from support import write_csv

    from towerflow.launch import train
    from towerflow.spec import validate_spec

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4))
    rows = [
        [i, *(repr(float(v)) for v in x[i]), repr(float(x[i].sum())), repr(float(x[i, 0]))]
        for i in range(256)
    ]
    write_csv(tmp_path / "train-00000-of-00001.csv", ["example_id", "a0", "a1", "a2", "a3", "t0", "t1"], rows)
    spec = validate_spec(
        {
            "name": "two-labels",
            "model": {
                "ref": "models.mlp:build",
                "params": {"input_dim": 4, "num_classes": 2, "seed": 1},
                "loss": "mse",
            },
            "data": {
                "train": {
                    "paths": str(tmp_path / "train-*.csv"),
                    "format": "csv",
                    "label": "y",
                    "groups": {"x": ["a*"], "y": ["t*"]},
                },
                "batch_size": 32,
                "epochs": 4,
            },
            "cluster": {"workers": 1, "ps": 1},
            "training": {"max_steps": 30, "optimizer": {"name": "adam", "learning_rate": 0.05}},
        }
    )
    result = train(spec, track=False, output_dir=tmp_path / "run")
    assert result.global_step == 30
    assert result.final_loss < 0.5  # the mean squared error of both targets went down from about 2.5


def test_s3_paths_reach_an_s3_filesystem():
    """s3:// resolves to s3fs's filesystem (installed with towerflow); reading needs credentials."""
    from towerflow.data.sources import _filesystem

    fs, path = _filesystem("s3://my-bucket/mnist/train-*")
    assert "s3" in fs.protocol and path == "my-bucket/mnist/train-*"


def test_a_manifest_counts_the_files_of_its_own_folder_only():
    """Read beside the first file, it named a file of another folder by its name alone: two
    folders of shards named alike took the first's counts, and a resume's position went wrong."""
    from towerflow.data.sources import examples_per_file

    manifest = {"splits": {"train": {"files": ["train-0", "train-1"], "per_file": [10, 20]}}}
    same = ["/d/a/train-0", "/d/a/train-1"]
    assert examples_per_file(same, manifest) == {"/d/a/train-0": 10, "/d/a/train-1": 20}
    assert examples_per_file(["/d/a/train-0", "/d/b/train-1"], manifest) is None  # counts unknown
