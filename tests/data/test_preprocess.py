"""Preprocessing hook points: per batch in Ray Data, per tower in TensorFlow, named by import string."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from support import write_uneven_shards

from models import mlp
from towerflow.errors import SpecError
from towerflow.launch import train
from towerflow.runtime.batches import TowerModel
from towerflow.spec import validate_spec

pytestmark = pytest.mark.timeout(300)
PARAMS = {"input_dim": 4, "num_classes": 2, "hidden": [8], "seed": 3}


def _spec(tmp_path, **train_extra):
    return validate_spec(
        {
            "name": "preprocess",
            "model": {"ref": "models.mlp:build", "params": PARAMS, "from_logits": True},
            "data": {
                "train": {"paths": str(tmp_path / "train-*"), **train_extra},
                "batch_size": 10,
                "epochs": 1,
                "drop_remainder": False,
            },
            "cluster": {"workers": 1, "ps": 1},
            "training": {
                "mode": "sync",
                "max_steps": 1000,
                "optimizer": {"name": "sgd", "learning_rate": 0.5},
            },
        }
    )


def test_batch_preprocess_runs_in_ray_data(ray_cluster, tmp_path):
    write_uneven_shards(tmp_path, [60, 40])
    result = train(_spec(tmp_path, preprocess=["tests.data.pipeline_fns:keep_even_ids"]), track=False)
    assert result.examples_seen == 50
    # Training moves the first kernel here (the tower test below relies on that to mean something).
    assert not np.allclose(result.parameters[0], mlp.build(**PARAMS).trainable_variables[0].numpy())


def test_tower_preprocess_runs_before_the_model(ray_cluster, tmp_path):
    write_uneven_shards(tmp_path, [60, 40])
    spec = _spec(tmp_path, tower_preprocess=["tests.data.pipeline_fns:zero_inputs_when_training"])
    result = train(spec, track=False)
    initial = mlp.build(**PARAMS).trainable_variables
    assert result.examples_seen == 100
    np.testing.assert_array_equal(result.parameters[0], initial[0].numpy())  # zero inputs: no kernel gradient


def test_tower_model_applies_functions_in_order_with_the_training_flag():
    model = mlp.build(**PARAMS)
    wrapped = TowerModel(
        model, ["tests.data.pipeline_fns:add_one", "tests.data.pipeline_fns:zero_inputs_when_training"]
    )
    x = tf.ones((3, 4))
    np.testing.assert_allclose(wrapped(x, training=True), model(tf.zeros((3, 4))), atol=1e-6)
    np.testing.assert_allclose(wrapped(x, training=False), model(x + 1.0), atol=1e-6)
    assert wrapped.trainable_variables == model.trainable_variables


def test_a_bad_import_string_fails_before_training(ray_cluster, tmp_path):
    write_uneven_shards(tmp_path, [10])
    with pytest.raises(SpecError, match=r"data.train.preprocess: .*no attribute 'nope'"):
        train(_spec(tmp_path, preprocess=["tests.data.pipeline_fns:nope"]), track=False)


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded-to-batch-longest"])
def test_varlen_feature_trains_end_to_end(ray_cluster, tmp_path, ragged):
    from support import write_examples

    examples = [{"ids": list(range(1, i % 5 + 2)), "label": [i % 2], "example_id": [i]} for i in range(60)]
    write_examples(tmp_path / "train-00000-of-00001", examples)
    features = {
        "ids": {"dtype": "int64", "varlen": True, "ragged": ragged, "default": -1},
        "label": {"dtype": "int64"},
        "example_id": {"dtype": "int64"},
    }
    if ragged:
        features["ids"].pop("default")
    spec = _spec(tmp_path, features=features)
    spec.model.ref = "tests.data.pipeline_fns:mean_of_ids"
    spec.model.params = {"ragged": ragged}
    result = train(spec, track=False)
    assert result.examples_seen == 60 and np.isfinite(result.final_loss)
