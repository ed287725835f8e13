"""Export a trained model: a SavedModel with a `serving_default` signature, logged to MLflow and registered.

The model is rebuilt from the spec's import string and given the trained weights (in
`model.trainable_variables` order, as the parameter servers hold them). The SavedModel is a small
`tf.Module` that tracks the Keras model and serves it two ways:
- `serving_default`: named inputs (the model's `keras.Input` names) -> `{output name: tensor}`,
  what TF Serving and `tf.saved_model.load(...).signatures["serving_default"]` use;
- `__call__`: one input tensor -> the output tensor, what MLflow's pyfunc wrapper calls.
A model with one input is logged as a TensorFlow model ("tf2-module" flavor); one with several named
inputs as a pyfunc model around the same SavedModel (`named_inputs_model.py`), since MLflow's
TensorFlow flavor serves one input tensor only. Both carry a tensor signature and an input example.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.errors import TowerflowError

MODEL_NAME = "model"  # the logged model's name inside the run


class ExportError(TowerflowError):
    """The trained model could not be exported or registered (the message says which step failed)."""

    exit_code = 1


@dataclass
class ExportedModel:
    model_uri: str  # models:/<model_id>, the logged model itself
    model_id: str
    registered_name: str | None = None
    version: str | None = None
    alias: str | None = None

    @property
    def registry_uri(self) -> str | None:
        """`models:/NAME@ALIAS`, what `mlflow.pyfunc.load_model` takes, when registered."""
        if self.registered_name and self.alias:
            return f"models:/{self.registered_name}@{self.alias}"
        return None


def load_run_spec(run_id: str, tracking_uri: str | None = None) -> Any:
    """The job spec a run was started with (its `spec.yaml` artifact), validated again."""
    import mlflow
    import yaml

    from towerflow.errors import SpecError
    from towerflow.spec import validate_spec
    from towerflow.tracking.mlflow_tracker import SPEC_ARTIFACT
    from towerflow.tracking.store import default_tracking_uri, run_unreadable, shown_address

    uri = default_tracking_uri(tracking_uri)
    try:
        mlflow.MlflowClient(uri).get_run(run_id)
    except mlflow.exceptions.MlflowException as exc:
        error = run_unreadable(exc, uri, f"run {run_id}")
        if isinstance(error, SpecError):
            raise TowerflowError(f"{error} (--store or MLFLOW_TRACKING_URI names another)") from None
        raise error from None
    try:
        local = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=SPEC_ARTIFACT, tracking_uri=uri
        )
        text = Path(local).read_text()
    except Exception as exc:
        raise ExportError(
            f"run {run_id} in {shown_address(uri)} has no readable {SPEC_ARTIFACT}: {exc}"
        ) from exc
    return validate_spec(yaml.safe_load(text), source=f"run {run_id}: {SPEC_ARTIFACT}")


def build_trained_model(
    spec: Any, weights: Sequence[np.ndarray], model_state: dict[str, np.ndarray] | None = None
) -> Any:
    """The spec's model with `weights` assigned to its trainable variables, in order, and
    `model_state` (non-trainable variables: batch-norm statistics) to the others, in order too."""
    from towerflow.imports import import_user_code
    from towerflow.runtime.model_state import assign_in_order, load_model_state

    model = import_user_code(spec.model.ref)(**spec.model.params)
    try:
        assign_in_order(model.trainable_variables, list(weights), "the trained weights")
        if model_state:
            load_model_state(model, model_state)
    except ValueError as exc:
        raise ExportError(
            f"{spec.model.ref}: {exc}: the weights do not belong to this model (check model.params)"
        ) from None
    return model


def serving_module(model: Any) -> tuple[Any, dict[str, Any]]:
    """A tf.Module around `model` and its `{"serving_default": concrete function}` signatures."""
    import tensorflow as tf

    specs = [
        tf.TensorSpec((None, *inp.shape[1:]), tf.as_dtype(inp.dtype), name=_input_name(inp))
        for inp in model.inputs
    ]
    output_names = [_output_name(model, i) for i in range(len(model.outputs))]

    def named_outputs(outputs: Any) -> dict[str, Any]:
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return dict(zip(output_names, outputs))

    module = tf.Module()
    module.model = model  # tracks the variables so the SavedModel holds them
    if len(specs) == 1:
        module.__call__ = tf.function(lambda x: model(x, training=False), input_signature=specs)
        serve = tf.function(lambda x: named_outputs(model(x, training=False)), input_signature=specs)
    else:
        by_name = {s.name: s for s in specs}
        module.__call__ = tf.function(lambda inputs: model(inputs, training=False), input_signature=[by_name])
        serve = tf.function(lambda **inputs: named_outputs(model(inputs, training=False)))
        serve = serve.get_concrete_function(**by_name)
    return module, {"serving_default": serve}


def mlflow_signature(model: Any) -> Any:
    """MLflow's tensor signature of the model, variable batch size.

    One input stays unnamed: MLflow's pyfunc turns an array into `{name: array}` for a named input,
    and its TensorFlow wrapper takes arrays only. (The SavedModel's `serving_default` keeps the name.)
    """
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    single = len(model.inputs) == 1
    inputs = Schema(
        [
            TensorSpec(np.dtype(str(inp.dtype)), (-1, *inp.shape[1:]), None if single else _input_name(inp))
            for inp in model.inputs
        ]
    )
    outputs = Schema(
        [
            TensorSpec(np.dtype(str(out.dtype)), (-1, *out.shape[1:]), _output_name(model, i))
            for i, out in enumerate(model.outputs)
        ]
    )
    return ModelSignature(inputs=inputs, outputs=outputs)


def example_input(model: Any, rows: int = 2) -> np.ndarray | dict[str, np.ndarray]:
    """A small deterministic input of the right shapes and dtypes (zeros), for MLflow's input example."""
    arrays = {
        _input_name(inp): np.zeros((rows, *inp.shape[1:]), dtype=str(inp.dtype)) for inp in model.inputs
    }
    return next(iter(arrays.values())) if len(arrays) == 1 else arrays


def export_model(
    spec: Any,
    weights: Sequence[np.ndarray],
    run_id: str,
    *,
    tracking_uri: str | None = None,
    register_as: str | None = None,
    alias: str | None = None,
    input_example: Any = None,
    model_state: dict[str, np.ndarray] | None = None,
) -> ExportedModel:
    """Build the spec's model with `weights`, log it to run `run_id` as a TensorFlow SavedModel, and
    register it as `register_as` (default: the spec's `export.register_as`) with `alias` (default: the
    spec's `export.alias`). Works on a running or a finished run."""
    import mlflow

    from towerflow.tf_import import import_tensorflow
    from towerflow.tracking.store import default_tracking_uri, shown_address, without_credentials

    tf = import_tensorflow(gpus=False)  # a driver's first: lean, and off the GPUs the workers use

    uri = default_tracking_uri(tracking_uri or spec.tracking.tracking_uri)
    register_as = register_as or spec.export.register_as
    alias = alias or spec.export.alias
    model = build_trained_model(spec, weights, model_state)
    module, signatures = serving_module(model)
    example = example_input(model) if input_example is None else input_example
    client = mlflow.MlflowClient(uri)
    with _tracking_uri(uri):
        try:
            run = client.get_run(run_id)
            # Created here, in the run's experiment: log_model alone would put it in the active (default)
            # experiment, where the run page does not list it.
            logged = client.create_logged_model(
                run.info.experiment_id,
                name=MODEL_NAME,
                source_run_id=run_id,
                params=dict(run.data.params),
                tags={"towerflow.job": spec.name},
            )
            info = _log_saved_model(
                module,
                signatures,
                single_input=len(model.inputs) == 1,
                name=MODEL_NAME,
                model_id=logged.model_id,
                run_id=run_id,
                signature=mlflow_signature(model),
                input_example=example,
                # Listing the requirements skips MLflow's inference, which re-imports the model in a
                # subprocess (seconds of TensorFlow start-up for nothing).
                pip_requirements=[f"tensorflow=={tf.__version__}"],
                registered_model_name=register_as,
            )
        except Exception as exc:
            raise ExportError(
                f"logging the SavedModel to run {run_id} at {shown_address(uri)} failed: "
                f"{without_credentials(str(exc))}"
            ) from exc
        exported = ExportedModel(model_uri=f"models:/{info.model_id}", model_id=info.model_id)
        if register_as:
            version = str(info.registered_model_version)
            try:
                client.set_registered_model_alias(register_as, alias, version)
            except Exception as exc:
                raise ExportError(
                    f"setting alias {alias!r} on {register_as} v{version} failed: {exc}"
                ) from exc
            exported.registered_name, exported.version, exported.alias = register_as, version, alias
    return exported


def _log_saved_model(
    module: Any, signatures: dict[str, Any], *, single_input: bool, **log_kwargs: Any
) -> Any:
    """Log `module` as a SavedModel: in MLflow's TensorFlow flavor when the model has one input,
    else as a pyfunc model from code that serves the SavedModel's named signature."""
    import mlflow
    import tensorflow as tf

    if single_input:
        return mlflow.tensorflow.log_model(
            module, saved_model_kwargs={"signatures": signatures}, **log_kwargs
        )
    from towerflow.tracking import named_inputs_model

    with tempfile.TemporaryDirectory(prefix="towerflow-export-") as scratch:
        folder = str(Path(scratch) / named_inputs_model.SAVED_MODEL_ARTIFACT)  # MLflow keeps the name
        tf.saved_model.save(module, folder, signatures=signatures)
        # Model.log, as pyfunc.log_model does, but with the run to log to (pyfunc.log_model takes
        # only the active run, and starting the run here would end it on the way out).
        return mlflow.models.Model.log(
            artifact_path=None,
            flavor=mlflow.pyfunc,
            python_model=named_inputs_model.__file__,
            artifacts={named_inputs_model.SAVED_MODEL_ARTIFACT: folder},
            **log_kwargs,
        )


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's log_model reads the global tracking URI: point it at `uri` for the call only."""
    import mlflow

    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)


def _input_name(keras_input: Any) -> str:
    return keras_input.name.split(":")[0]


def _output_name(model: Any, index: int) -> str:
    names = getattr(model, "output_names", None) or []
    return names[index] if index < len(names) else f"output_{index}"


def export_run(run_id: str, tracking_uri: str | None = None) -> ExportedModel:
    """`towerflow export RUN_ID`: export the weights of the run's latest checkpoint, on demand.
    Where this process has not imported TensorFlow yet, it is imported with every GPU hidden."""
    from mlflow.tracking import MlflowClient

    from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
    from towerflow.checkpoint.resume import latest_checkpoint
    from towerflow.tracking.store import default_tracking_uri

    uri = default_tracking_uri(tracking_uri)
    spec = load_run_spec(run_id, uri)
    state = latest_checkpoint(MlflowCheckpointStore(MlflowClient(uri), run_id), f"run {run_id}").read()
    weights = [state.variables[name] for name in state.names]
    return export_model(spec, weights, run_id, tracking_uri=uri, model_state=state.model_state)
