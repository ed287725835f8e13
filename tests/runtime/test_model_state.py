"""Non-trainable model state (batch-norm moving statistics): averaged over workers, checkpointed,
restored on resume, used by export."""

from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from support import blobs, mlflow_uri, ray_actors, tracked_spec

from towerflow.checkpoint.files import read_checkpoint, write_checkpoint
from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.checkpoint.state import TrainingState
from towerflow.launch import train
from towerflow.runtime.actor_pool import release_kept_actors
from towerflow.runtime.model_state import average_model_states, load_model_state, model_state_of


def test_worker_states_are_averaged_in_their_dtype():
    states = [
        {
            "bn/moving_mean": np.array([0.0, 2.0], np.float32),
            "bn/moving_variance": np.array([1.0], np.float64),
        },
        {
            "bn/moving_mean": np.array([1.0, 4.0], np.float32),
            "bn/moving_variance": np.array([3.0], np.float64),
        },
    ]
    averaged = average_model_states(states)
    np.testing.assert_array_equal(averaged["bn/moving_mean"], [0.5, 3.0])
    assert (
        averaged["bn/moving_mean"].dtype == np.float32 and averaged["bn/moving_variance"].dtype == np.float64
    )
    assert average_model_states([]) == {}


def test_seed_generator_states_are_each_workers_own():
    import keras

    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization()(keras.layers.Dense(3)(inputs))
    model = keras.Model(inputs, keras.layers.Dropout(0.5)(x))
    assert any("seed_generator" in v.path for v in model.non_trainable_variables)
    assert [name.split("/")[-1] for name in model_state_of(model)] == ["moving_mean", "moving_variance"]


def test_a_state_of_the_wrong_shape_is_refused():
    from models.mlp import build

    model = build(input_dim=4, hidden=[3], batch_norm=True, seed=0)
    state = {v.path: np.zeros(v.shape, np.float32) for v in model.non_trainable_variables}
    first = next(iter(state))
    with pytest.raises(ValueError, match="the saved model state: 1 arrays for the model's 2 variables"):
        load_model_state(model, {first: state[first]})
    with pytest.raises(ValueError, match="moving_mean: shape \\(5,\\) in the saved model state"):
        load_model_state(model, {**state, first: np.zeros(5, np.float32)})
    assert load_model_state(model, state) == 2


def test_checkpoint_files_round_trip_the_model_state(tmp_path):
    state = TrainingState(
        global_step=3,
        optimizer="sgd",
        names=["dense/kernel"],
        variables={"dense/kernel": np.ones((2, 2), np.float32)},
        slots={},
        model_state={"batch_normalization/moving_variance": np.array([0.25, 4.0], np.float32)},
    )
    back = read_checkpoint(write_checkpoint(state, tmp_path))
    np.testing.assert_array_equal(back.model_state["batch_normalization/moving_variance"], [0.25, 4.0])


def test_batch_norm_statistics_are_trained_checkpointed_resumed_evaluated_and_exported(
    ray_cluster, blob_data, tmp_path
):
    import keras
    import mlflow

    spec, uri = tracked_spec(
        tmp_path,
        blob_data,
        "model-state",
        model={"params": {"input_dim": 8, "num_classes": 2, "hidden": [16], "seed": 1, "batch_norm": True}},
        cluster={"workers": 2, "ps": 1},  # two workers' statistics are averaged
        data={"epochs": None, "eval": {"paths": str(blob_data / "train-00000-*")}},
        training={"max_steps": 6, "optimizer": {"name": "sgd", "learning_rate": 0.1}},
        # due at the last step, evaluated at the end: on a worker, idle by then, with the averaged statistics
        supervision={"checkpoint": {"every_steps": 3}, "eval": {"every_steps": 6}},
        export={"saved_model": True},
    )
    release_kept_actors()  # an earlier run's: this run starts its own two workers
    started = len(ray_actors("TowerWorker"))
    result = train(spec)
    assert len(ray_actors("TowerWorker")) - started == 2  # the two workers: no evaluator actor was started
    means = {k: v for k, v in result.model_state.items() if "moving_mean" in k}
    assert means and all(np.abs(v).max() > 0.01 for v in means.values())  # they moved off their zeros

    client = MlflowClient(uri)
    store = MlflowCheckpointStore(client, result.run_id)
    final = store.load(6)
    for name, value in result.model_state.items():
        np.testing.assert_allclose(final.model_state[name], value, rtol=1e-6)

    # The exported model predicts with the trained statistics, not BatchNormalization's initial ones.
    from towerflow.tracking.export import build_trained_model

    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    expected = np.asarray(build_trained_model(spec, result.parameters, result.model_state)(x, training=False))
    initial_stats = np.asarray(build_trained_model(spec, result.parameters)(x, training=False))
    assert not np.allclose(initial_stats, expected, atol=1e-3)  # the comparisons below mean something
    # The final evaluation saw the trained statistics too (the eval file: blob_data's first 256 rows).
    rows = blobs(1024)
    x_eval, y_eval = rows["x"][:256], rows["label"][:256]

    def eval_loss(model_state):
        logits = build_trained_model(spec, result.parameters, model_state)(x_eval, training=False)
        return float(np.mean(keras.losses.sparse_categorical_crossentropy(y_eval, logits, from_logits=True)))

    evaluated = client.get_run(result.run_id).data.metrics
    assert evaluated["eval_examples"] == 256
    assert evaluated["eval_loss"] == pytest.approx(eval_loss(result.model_state), rel=1e-4)
    assert evaluated["eval_loss"] != pytest.approx(eval_loss(None), rel=1e-4)
    model_uri = client.get_run(result.run_id).data.tags["towerflow.model_uri"]
    with mlflow_uri(uri):
        served = mlflow.pyfunc.load_model(model_uri)
        np.testing.assert_allclose(np.asarray(served.predict(x)), expected, atol=1e-5)

    # Resume: the workers start from the checkpoint's statistics. With no step left to train, the
    # run ends on exactly what it restored (a fresh start would report BatchNormalization's zeros).
    resumed = train(spec, resume=result.run_id)
    assert resumed.global_step == 6
    for name, value in final.model_state.items():
        np.testing.assert_array_equal(resumed.model_state[name], value)
