"""Synthetic MNIST: named shards, a manifest that matches them, determinism, and learnability."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from towerflow.data.synth import synth_mnist
from towerflow.data.tfrecord import read_tfrecord_file
from towerflow.errors import TowerflowError


def _read(folder, files, features):
    columns = {}
    for name in files:
        for batch in read_tfrecord_file(str(folder / name), features):
            for key, value in batch.items():
                columns.setdefault(key, []).append(value)
    return {k: np.concatenate(v) for k, v in columns.items()}


def test_shards_and_manifest(tmp_path):
    manifest = synth_mnist(tmp_path, shards=4, examples=2000, eval_examples=500, seed=3)
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    train = manifest["splits"]["train"]
    assert train["files"] == [f"train-{i:05d}-of-00004" for i in range(4)]
    assert sum(train["per_file"]) == train["examples"] == 2000
    for split in manifest["splits"].values():
        for name, count in zip(split["files"], split["per_file"]):
            assert sum(1 for _ in tf.data.TFRecordDataset(str(tmp_path / name))) == count
    data = _read(tmp_path, train["files"], manifest["features"])
    evals = _read(tmp_path, manifest["splits"]["eval"]["files"], manifest["features"])
    assert data["image"].shape == (2000, 28, 28, 1) and data["image"].dtype == np.uint8
    assert set(np.unique(data["label"])) == set(range(10))
    ids = np.concatenate([data["example_id"], evals["example_id"]])
    assert len(np.unique(ids)) == 2500 and ids.min() == 0 and ids.max() == 2499
    assert manifest["splits"]["eval"]["files"] == ["eval-00000-of-00001"]
    assert set(manifest["features"]) == {"image", "label", "example_id"}
    assert not {x.tobytes() for x in data["image"]} & {x.tobytes() for x in evals["image"]}
    assert not list(tmp_path.glob(".*tmp"))


def test_rewrite_drops_stale_shards_and_sharding_does_not_change_the_examples(tmp_path):
    four = synth_mnist(tmp_path, shards=4, examples=103, eval_examples=0, seed=5)
    assert four["splits"]["train"]["per_file"] == [26, 26, 26, 25]
    before = _read(tmp_path, four["splits"]["train"]["files"], four["features"])
    one = synth_mnist(tmp_path, shards=1, examples=103, eval_examples=0, seed=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "train-00000-of-00001"]
    after = _read(tmp_path, one["splits"]["train"]["files"], one["features"])
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_too_few_examples_for_the_shards_is_a_user_error(tmp_path):
    with pytest.raises(TowerflowError, match="train"):
        synth_mnist(tmp_path, shards=8, examples=5, eval_examples=0)
    assert not (tmp_path / "manifest.json").exists()


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, b, c = (
        synth_mnist(tmp_path / n, shards=1, examples=50, eval_examples=0, seed=s)
        for n, s in (("a", 1), ("b", 1), ("c", 2))
    )
    read = lambda n: (tmp_path / n / "train-00000-of-00001").read_bytes()  # noqa: E731
    assert read("a") == read("b") != read("c")
    assert "eval" not in a["splits"]


def test_a_cnn_learns_it_and_a_linear_model_does_not_as_well(tmp_path):
    manifest = synth_mnist(tmp_path, shards=2, examples=6000, eval_examples=1000, seed=0)
    train = _read(tmp_path, manifest["splits"]["train"]["files"], manifest["features"])
    evals = _read(tmp_path, manifest["splits"]["eval"]["files"], manifest["features"])
    x, y = train["image"].astype(np.float32) / 255, train["label"]
    xe, ye = evals["image"].astype(np.float32) / 255, evals["label"]

    def fit(layers):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((28, 28, 1)), *layers, keras.layers.Dense(10)])
        model.compile(
            "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
        model.fit(x, y, batch_size=64, epochs=3, verbose=0)
        return model.evaluate(xe, ye, verbose=0)[1]

    cnn = fit(
        [
            keras.layers.Conv2D(16, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
        ]
    )
    linear = fit([keras.layers.Flatten()])
    assert cnn > 0.9, cnn
    assert cnn - linear > 0.05, (cnn, linear)


def test_csv_form_has_one_column_per_pixel_and_the_same_digits(tmp_path):
    from synth_support import read_split

    csv = synth_mnist(tmp_path / "csv", shards=3, examples=300, eval_examples=30, seed=7, fmt="csv")
    rec = synth_mnist(tmp_path / "rec", shards=2, examples=300, eval_examples=30, seed=7)
    assert list(csv["features"])[:3] == ["example_id", "label", "px000"]
    assert list(csv["features"])[-1] == "px783" and len(csv["features"]) == 786
    assert all(f == {"dtype": "int64", "shape": []} for f in csv["features"].values())
    assert csv["image_columns"]["shape"] == [28, 28, 1] and csv["csv"]["header"] is True
    assert csv["splits"]["train"]["files"][0] == "train-00000-of-00003.csv"
    a, b = read_split(tmp_path / "csv", csv), read_split(tmp_path / "rec", rec)
    pixels = np.stack([a[f"px{i:03d}"] for i in range(784)], axis=1).reshape(-1, 28, 28, 1)
    assert np.array_equal(pixels, b["image"]) and np.array_equal(a["label"], b["label"])
    assert np.array_equal(a["example_id"], np.arange(300))
    assert csv["class_counts"]["train"] == np.bincount(b["label"], minlength=10).tolist()
