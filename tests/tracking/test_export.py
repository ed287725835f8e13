"""Export: a finished run's model as a SavedModel in MLflow, registered under an alias, that predicts
exactly what the trained weights predict."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from conftest import REPO
from mlflow.tracking import MlflowClient
from support import ONE_OF_EACH, blob_spec, blobs, mlflow_uri, sqlite_store, tracked_spec

from towerflow.errors import SpecError, TowerflowError
from towerflow.imports import import_ref
from towerflow.launch import train
from towerflow.spec import load_spec, validate_spec
from towerflow.tracking.export import ExportError, build_trained_model, export_model, load_run_spec
from towerflow.tracking.store import ensure_experiment


def test_registered_model_predicts_like_the_trained_weights(exported_run):
    spec, uri, result = exported_run
    x = blobs(16, seed=3)["x"]
    expected = build_trained_model(spec, result.parameters)(x, training=False).numpy()
    untrained = build_trained_model(spec, [np.zeros_like(p) for p in result.parameters])(x).numpy()
    assert not np.allclose(expected, untrained)  # the comparison below means something

    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["towerflow.registered_model"] == "models:/blobs-mlp@champion"
    version = client.get_model_version_by_alias("blobs-mlp", "champion")
    assert version.run_id == result.run_id

    with mlflow_uri(uri):
        served = mlflow.pyfunc.load_model("models:/blobs-mlp@champion")
        np.testing.assert_allclose(served.predict(x), expected, atol=1e-5)
        assert served.metadata.get_input_schema().inputs[0].shape == (-1, 8)
        local = Path(mlflow.artifacts.download_artifacts(run.data.tags["towerflow.model_uri"]))
    assert (local / "input_example.json").exists()
    saved = tf.saved_model.load(str(local / "tf2model"))
    outputs = saved.signatures["serving_default"](x=tf.constant(x))
    np.testing.assert_allclose(outputs["logits"].numpy(), expected, atol=1e-5)


def test_export_on_demand_adds_a_version_under_its_own_alias(exported_run):
    spec, uri, result = exported_run
    exported = export_model(spec, result.parameters, result.run_id, alias="staging")
    assert exported.registered_name == "blobs-mlp" and exported.version == "2"
    assert exported.registry_uri == "models:/blobs-mlp@staging"
    client = MlflowClient(uri)
    assert str(client.get_model_version_by_alias("blobs-mlp", "staging").version) == "2"
    assert str(client.get_model_version_by_alias("blobs-mlp", "champion").version) == "1"


def test_weights_of_another_model_are_refused(exported_run):
    spec, _, result = exported_run
    with pytest.raises(ExportError, match="the trained weights: 3 arrays for the model's 4 variables"):
        build_trained_model(spec, result.parameters[:-1])
    wrong = [np.zeros((3, 3), np.float32)] + list(result.parameters[1:])
    with pytest.raises(ExportError, match=r"shape \(3, 3\) in the trained weights, .* do not belong"):
        build_trained_model(spec, wrong)


def test_the_run_keeps_its_spec_for_later_exports(exported_run):
    spec, uri, result = exported_run
    assert load_run_spec(result.run_id, uri).model_dump() == spec.model_dump()
    with pytest.raises(
        TowerflowError, match="run 0123456789abcdef: no such run in the MLflow store"
    ) as raised:
        load_run_spec("0123456789abcdef", uri)
    assert raised.value.exit_code == 2  # the user's input, as a misspelt --resume is


def test_a_failed_export_fails_the_run(ray_cluster, blob_data, tmp_path):
    spec, uri = tracked_spec(
        tmp_path,
        blob_data,
        "bad-export",
        cluster=ONE_OF_EACH,
        training={"max_steps": 2},
        export={"saved_model": True, "register_as": "blobs-bad", "alias": "latest"},  # reserved by MLflow
    )
    with pytest.raises(ExportError, match="latest"):
        train(spec)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("bad-export").experiment_id])
    assert run.info.status == "FAILED" and "reserved" in run.data.tags["towerflow.error"]


def test_registered_names_mlflow_refuses_are_spec_errors(blob_data):
    with pytest.raises(SpecError, match="export.register_as"):
        validate_spec(blob_spec(blob_data, export={"saved_model": True, "register_as": "team/model"}))
    with pytest.raises(SpecError, match="export.alias"):
        validate_spec(blob_spec(blob_data, export={"alias": "best model"}))


def test_a_model_with_several_named_inputs_serves_dicts_and_dataframes(tmp_path):
    """MLflow's TensorFlow flavor takes one input tensor; the tabular model takes `x` and `category`."""
    uri = sqlite_store(tmp_path)
    spec = load_spec(REPO / "pipelines" / "tabular_csv.yaml", [f"tracking.tracking_uri={uri}"])
    model = import_ref(spec.model.ref)(**spec.model.params)
    weights = [v.numpy() for v in model.trainable_variables]
    rng = np.random.default_rng(0)
    inputs = {"x": rng.normal(size=(5, 30)).astype(np.float32), "category": np.array([0, 3, 7, 1, 2])}
    expected = model(inputs, training=False).numpy()

    client = MlflowClient(uri)
    run = client.create_run(ensure_experiment(client, "tabular", uri))  # artifacts beside the store
    exported = export_model(spec, weights, run.info.run_id, tracking_uri=uri)
    assert exported.registry_uri == "models:/tabular-mlp@champion"

    with mlflow_uri(uri):
        served = mlflow.pyfunc.load_model(exported.registry_uri)
        assert {i.name for i in served.metadata.get_input_schema().inputs} == {"x", "category"}
        np.testing.assert_allclose(served.predict(inputs), expected, atol=1e-5)
        frame = pd.DataFrame({"x": list(inputs["x"]), "category": inputs["category"]})
        np.testing.assert_allclose(served.predict(frame), expected, atol=1e-5)
        with pytest.raises(mlflow.exceptions.MlflowException, match="category"):
            served.predict({"x": inputs["x"]})
        local = Path(mlflow.artifacts.download_artifacts(exported.registry_uri))
    saved = tf.saved_model.load(str(local / "artifacts" / "saved_model"))
    outputs = saved.signatures["serving_default"](
        x=tf.constant(inputs["x"]), category=tf.constant(inputs["category"])
    )
    np.testing.assert_allclose(outputs["logits"].numpy(), expected, atol=1e-5)
