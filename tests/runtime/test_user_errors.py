"""A job that cannot train ends with one clear error and its MLflow run FAILED: a misspelt model ref
or parameter is named by the driver before any actor starts; a user error raised in a worker's
constructor comes back as itself, and any other leads with what was raised; a loss, labels and model
output that do not fit are named at the first step; data too small for one step is named instead of
an untrained model exported."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from support import ONE_OF_EACH, tracked_spec, write_uneven_shards

from towerflow.errors import DataError, SpecError, TrainingError
from towerflow.launch import train

pytestmark = pytest.mark.timeout(300)


def _fails_with(tmp_path, blob_data, model: dict, pattern: str, error=SpecError) -> str:
    base = tracked_spec(tmp_path, blob_data, "model-errors")[0].model.model_dump()
    spec, uri = tracked_spec(
        tmp_path, blob_data, "model-errors", model={**base, **model}, cluster=ONE_OF_EACH
    )
    with pytest.raises(error, match=pattern) as raised:
        train(spec)
    assert "ray::" not in str(raised.value) and "pid=" not in str(raised.value)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("model-errors").experiment_id])
    assert run.info.status == "FAILED"
    assert str(raised.value) in run.data.tags["towerflow.error"]
    return str(raised.value)


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


def test_a_model_module_that_does_not_compile_is_named_with_its_file_and_line(
    ray_cluster, blob_data, tmp_path, monkeypatch
):
    # Found by the driver before any actor starts: a bad input, not an internal error.
    (tmp_path / "broken_model.py").write_text("def build(input_dim:\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = _fails_with(
        tmp_path,
        blob_data,
        {"ref": "broken_model:build"},
        r"^model\.ref: importing 'broken_model' failed: .*broken_model\.py, line 1: '\(' was never closed",
    )
    assert "Traceback" not in message


def test_a_user_error_in_a_workers_constructor_comes_back_as_itself(ray_cluster, blob_data, tmp_path):
    model = {"ref": "tests.runtime.model_fns:unbuilt", "params": {}}
    _fails_with(
        tmp_path,
        blob_data,
        model,
        r"^model\.ref: tests\.runtime\.model_fns:unbuilt built a model with no trainable",
    )


def test_an_error_in_the_model_code_leads_with_what_was_raised_and_keeps_the_traceback(
    ray_cluster, blob_data, tmp_path
):
    # A value the builder's signature accepts but Keras does not: only building the model can tell.
    model = {"params": {"input_dim": 8, "num_classes": 2, "hidden": ["wide"]}}
    message = _fails_with(
        tmp_path, blob_data, model, r"^TowerWorker failed to start: ValueError: ", TrainingError
    )
    assert "units=wide" in message.splitlines()[0]
    assert 'models/mlp.py", line' in message  # the frame in the user's model code


@pytest.mark.parametrize(
    "model, raised",
    [
        # Caught when the step is traced: a loss for one output against a model with two.
        ({"loss": "mse"}, r"ValueError: Dimensions must be equal"),
        # Caught when the step runs: labels 0 and 1 against a model with one class.
        (
            {"params": {"input_dim": 8, "num_classes": 1, "hidden": [16]}},
            r"InvalidArgumentError: Received a label value of 1",
        ),
    ],
)
def test_a_loss_or_output_size_that_does_not_fit_the_labels_is_named(
    ray_cluster, blob_data, tmp_path, model, raised
):
    pattern = rf"^model: the first training step failed \({raised}.*\)\. The model, its loss and the data do not fit"
    message = _fails_with(tmp_path, blob_data, model, pattern)
    assert (
        "the data gives the model x float32 [32, 8], and labels (data.train.label 'label') int64 [32]"
        in message
    )
    assert "model.loss is" in message and "outputs (None, " in message


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
