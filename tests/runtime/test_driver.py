"""A model the spec gets wrong ends the job with one SpecError naming the key, the MLflow run FAILED:
misspelt refs and parameters are caught by the driver before any actor starts, and a user error raised
in a worker's constructor comes back as itself, not as Ray's wrapper."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from support import ONE_OF_EACH, tracked_spec, write_uneven_shards

from towerflow.errors import DataError, SpecError
from towerflow.launch import train

pytestmark = pytest.mark.timeout(300)


def _fails_with(tmp_path, blob_data, model: dict, pattern: str) -> None:
    base = tracked_spec(tmp_path, blob_data, "model-errors")[0].model.model_dump()
    spec, uri = tracked_spec(
        tmp_path, blob_data, "model-errors", model={**base, **model}, cluster=ONE_OF_EACH
    )
    with pytest.raises(SpecError, match=pattern) as raised:
        train(spec)
    assert "ray::" not in str(raised.value) and "Traceback" not in str(raised.value)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("model-errors").experiment_id])
    assert run.info.status == "FAILED"
    assert str(raised.value) in run.data.tags["towerflow.error"]


def test_a_misspelt_model_parameter_is_named_with_those_the_builder_takes(ray_cluster, blob_data, tmp_path):
    params = {"input_dim": 8, "num_classes": 2, "hiddden": [16]}
    pattern = (
        r"model\.params: got an unexpected keyword argument 'hiddden' \(models\.mlp:build takes: input_dim, "
    )
    _fails_with(tmp_path, blob_data, {"params": params}, pattern)


def test_a_model_ref_to_a_missing_function_is_named(ray_cluster, blob_data, tmp_path):
    _fails_with(
        tmp_path,
        blob_data,
        {"ref": "models.mlp:biuld"},
        r"model\.ref: module 'models\.mlp' has no attribute 'biuld'",
    )


def test_a_user_error_in_a_workers_constructor_comes_back_as_itself(ray_cluster, blob_data, tmp_path):
    model = {"ref": "tests.runtime.model_fns:unbuilt", "params": {}}
    _fails_with(
        tmp_path,
        blob_data,
        model,
        r"^model\.ref: tests\.runtime\.model_fns:unbuilt built a model with no trainable",
    )


def test_data_that_ends_before_the_first_step_fails_the_run(ray_cluster, tmp_path):
    # No manifest, so the example count is unknown until the data ends: 40 examples, batches of 64.
    write_uneven_shards(tmp_path / "data", [20, 20], dim=8)
    spec, uri = tracked_spec(tmp_path, tmp_path / "data", "model-errors", cluster=ONE_OF_EACH)
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"batch_size": 64})})
    with pytest.raises(
        DataError, match=r"data.train: the data ended before the first training step .*batch_size 64"
    ):
        train(spec)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("model-errors").experiment_id])
    assert run.info.status == "FAILED"
