"""Export: a finished run's model as a SavedModel in MLflow, registered under an alias, that predicts
exactly what the trained weights predict."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient
from support import blobs

from towerflow.tracking.export import ExportError, build_trained_model, export_model


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
    with pytest.raises(ExportError, match="trainable variables"):
        build_trained_model(spec, result.parameters[:-1])
    wrong = [np.zeros((3, 3), np.float32)] + list(result.parameters[1:])
    with pytest.raises(ExportError, match="has shape"):
        build_trained_model(spec, wrong)


class mlflow_uri:
    """Point MLflow's global tracking URI at a test store for a block."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    def __enter__(self) -> None:
        mlflow.set_tracking_uri(self.uri)

    def __exit__(self, *exc) -> None:
        mlflow.set_tracking_uri(None)
