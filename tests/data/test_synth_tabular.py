"""Synthetic tabular data: same examples in CSV and TFRecord, imbalance in the manifest, learnable."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from synth_support import read_split

from towerflow.data.synth import synth_tabular
from towerflow.data.synth.tabular import FEATURES
from towerflow.errors import SpecError


def test_csv_and_tfrecord_hold_the_same_examples_with_the_same_names(tmp_path):
    common = {"shards": 3, "examples": 500, "eval_examples": 100, "seed": 4}
    csv = synth_tabular(tmp_path / "csv", fmt="csv", **common)
    rec = synth_tabular(tmp_path / "rec", fmt="tfrecord", **common)
    assert json.loads((tmp_path / "csv" / "manifest.json").read_text()) == csv
    assert csv["csv"] == {"header": True, "delimiter": ","}
    assert "csv" not in rec
    assert list(csv["features"]) == ["example_id", *FEATURES, "category", "label"]
    assert csv["features"] == rec["features"]
    assert csv["splits"]["train"]["files"] == [f"train-{i:05d}-of-00003.csv" for i in range(3)]
    assert rec["splits"]["train"]["files"] == [f"train-{i:05d}-of-00003" for i in range(3)]
    header = (tmp_path / "csv" / csv["splits"]["train"]["files"][0]).read_text().splitlines()[0]
    assert header.split(",") == list(csv["features"])
    for split in ("train", "eval"):
        a, b = read_split(tmp_path / "csv", csv, split), read_split(tmp_path / "rec", rec, split)
        for name in csv["features"]:
            # CSV floats are shortest round-trip text: parsed back, they equal the float32 values exactly.
            assert np.array_equal(a[name].astype(b[name].dtype), b[name]), name
    assert b["f00"].dtype == np.float32 and b["category"].dtype == np.int64
    ids = np.concatenate([read_split(tmp_path / "csv", csv)["example_id"], a["example_id"]])
    assert sorted(ids) == list(range(600))


def test_shard_count_does_not_change_the_examples(tmp_path):
    one = synth_tabular(tmp_path / "one", shards=1, examples=9000, eval_examples=0, fmt="csv", seed=2)
    five = synth_tabular(tmp_path / "five", shards=5, examples=9000, eval_examples=0, fmt="csv", seed=2)
    assert five["splits"]["train"]["per_file"] == [1800] * 5
    a, b = read_split(tmp_path / "one", one), read_split(tmp_path / "five", five)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    other = read_split(
        tmp_path / "one",
        synth_tabular(tmp_path / "one", shards=1, examples=9000, eval_examples=0, fmt="csv", seed=3),
    )
    assert not np.array_equal(a["f00"], other["f00"])


def test_imbalance_and_classes_are_reflected_in_the_manifest(tmp_path):
    manifest = synth_tabular(
        tmp_path, shards=2, examples=4000, eval_examples=1000, fmt="csv", imbalance=0.1, num_classes=3
    )
    data, evals = read_split(tmp_path, manifest), read_split(tmp_path, manifest, "eval")
    assert manifest["num_classes"] == 3 and manifest["imbalance"] == 0.1
    assert manifest["class_priors"] == pytest.approx([0.45, 0.45, 0.1])
    assert manifest["class_counts"]["train"] == np.bincount(data["label"], minlength=3).tolist()
    assert manifest["class_counts"]["eval"] == np.bincount(evals["label"], minlength=3).tolist()
    assert abs(manifest["class_counts"]["train"][2] / 4000 - 0.1) < 0.02
    assert data["category"].min() >= 0 and data["category"].max() < manifest["num_categories"]
    assert len(manifest["informative_features"]) == 8


@pytest.mark.parametrize("options", [{"imbalance": 0.0}, {"imbalance": 1.0}, {"num_classes": 1}])
def test_bad_options_are_spec_errors(tmp_path, options):
    with pytest.raises(SpecError, match="tabular"):
        synth_tabular(tmp_path, examples=10, eval_examples=0, shards=1, **options)


def _fit_logistic(train, evals, num_classes, num_categories, use_numeric=True):
    """A multinomial logistic regression on standardised features plus the one-hot category."""

    def design(d, mean, std):
        parts = [np.eye(num_categories, dtype=np.float32)[d["category"]]]
        if use_numeric:
            parts.insert(0, (np.stack([d[f] for f in FEATURES], axis=1) - mean) / std)
        return np.concatenate(parts, axis=1)

    numeric = np.stack([train[f] for f in FEATURES], axis=1)
    mean, std = numeric.mean(axis=0), numeric.std(axis=0)
    x, xe = design(train, mean, std), design(evals, mean, std)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(num_classes)])
    model.compile(
        keras.optimizers.Adam(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, train["label"], batch_size=256, epochs=15, verbose=0)
    return model.evaluate(xe, evals["label"], verbose=0)[1]


@pytest.mark.parametrize("imbalance", [None, 0.1])
def test_a_logistic_regression_beats_the_majority_baseline(tmp_path, imbalance):
    manifest = synth_tabular(tmp_path, shards=2, examples=8000, eval_examples=2000, imbalance=imbalance)
    train, evals = read_split(tmp_path, manifest), read_split(tmp_path, manifest, "eval")
    baseline = np.bincount(evals["label"]).max() / len(evals["label"])
    accuracy = _fit_logistic(train, evals, 2, manifest["num_categories"])
    category_only = _fit_logistic(train, evals, 2, manifest["num_categories"], use_numeric=False)
    margin = 0.25 if imbalance is None else 0.03
    assert accuracy > baseline + margin, (accuracy, baseline)
    # The category alone carries signal of its own on balanced classes.
    if imbalance is None:
        assert category_only > baseline + 0.05, (category_only, baseline)
