"""The MLflow pyfunc model of an exported SavedModel whose model takes several named inputs.

MLflow's TensorFlow flavor serves one input tensor only: its pyfunc wrapper refuses the dict that a
model with several `keras.Input`s needs. Those models are logged as a pyfunc "model from code"
instead: MLflow copies this file into the logged model and runs it at load time, so it imports
nothing of towerflow. `predict` takes a dict of arrays or a pandas DataFrame (one column per input)
and calls the SavedModel's `serving_default` signature.
"""

from __future__ import annotations

from typing import Any

import mlflow
import numpy as np

SAVED_MODEL_ARTIFACT = "saved_model"  # the key of the SavedModel folder among the model's artifacts


class NamedInputsSavedModel(mlflow.pyfunc.PythonModel):
    # The logged model's tensor signature validates every input already. MLflow's type-hint check of
    # `predict` (which wants list[...] hints, and warns without them) is skipped, as for its ChatModel.
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        import tensorflow as tf

        self._tf = tf
        # Held, not only its signature: a concrete function keeps only weak references to the variables.
        self._saved = tf.saved_model.load(context.artifacts[SAVED_MODEL_ARTIFACT])
        self._serve = self._saved.signatures["serving_default"]
        self._inputs = self._serve.structured_input_signature[1]  # input name -> tf.TensorSpec

    def predict(self, context, model_input, params=None):  # untyped: MLflow reads hints as a schema
        """The model's output for `model_input`: one array, or `{output name: array}` for several."""
        columns = _columns(model_input)  # every input is there: MLflow checked it against the signature
        feed = {
            name: self._tf.constant(np.asarray(columns[name], dtype=spec.dtype.as_numpy_dtype))
            for name, spec in self._inputs.items()
        }
        outputs = {name: value.numpy() for name, value in self._serve(**feed).items()}
        return next(iter(outputs.values())) if len(outputs) == 1 else outputs


def _columns(model_input: Any) -> dict[str, np.ndarray]:
    """A dict of arrays from a dict, or from a DataFrame whose cells may hold arrays (vector inputs)."""
    if isinstance(model_input, dict):
        return {name: np.asarray(value) for name, value in model_input.items()}
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        return {name: np.stack(model_input[name].to_numpy()) for name in model_input.columns}
    raise TypeError(
        f"a model with several named inputs takes a dict of arrays or a pandas DataFrame, not {type(model_input).__name__}"
    )


mlflow.models.set_model(NamedInputsSavedModel())
