"""A model's floating-point non-trainable variables (batch-norm moving statistics), by variable path.

They are not on the parameter servers: no gradient reaches them. Each worker updates its own copy
as it trains, as each replica does under TensorFlow's MirroredStrategy, and readers (checkpoints,
evaluation, export) take the workers' mean, as MirroredStrategy's ON_READ MEAN aggregation does.
Integer ones (Keras's random seed-generator states) are each worker's own and are left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def stateful_variables(model: Any) -> list[Any]:
    """The non-trainable variables that make up model state, in model order."""
    return [var for var in model.non_trainable_variables if np.dtype(var.dtype).kind == "f"]


def model_state_of(model: Any) -> dict[str, np.ndarray]:
    return {var.path: np.array(var.numpy()) for var in stateful_variables(model)}


def load_model_state(model: Any, state: dict[str, np.ndarray]) -> int:
    """Assign `state` to the model's non-trainable variables in model order; returns how many.

    By position, as trainable weights are: Keras names layers per process (`batch_normalization_3`
    where another model was built before), so paths differ between the workers and an exporter.
    """
    variables = stateful_variables(model)
    assign_in_order(variables, list(state.values()), "the saved model state", names=list(state))
    return len(variables)


def assign_in_order(
    variables: list[Any], values: list[Any], what: str, *, names: list[str] | None = None
) -> None:
    """Assign `values` to `variables` by position, once their number and every shape fit; else a
    ValueError says what does not fit, naming `what` and the value (by `names`, else the variable)."""
    if len(variables) != len(values):
        raise ValueError(f"{what}: {len(values)} arrays for the model's {len(variables)} variables")
    for i, (var, value) in enumerate(zip(variables, values)):
        value = np.asarray(value)
        if tuple(value.shape) != tuple(var.shape):
            name = names[i] if names else var.path
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} in {what}, {tuple(var.shape)} in the model's {var.path}"
            )
    for var, value in zip(variables, values):
        var.assign(np.asarray(value).astype(np.dtype(var.dtype)))


def average_model_states(states: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The workers' states averaged, variable by variable, in the dtype they came in.

    Matched by position, as `load_model_state` does, and named as the first state names them.
    """
    if not states:
        return {}
    columns = zip(*(s.values() for s in states), strict=True)
    return {
        name: np.mean(np.stack(values), axis=0).astype(values[0].dtype)
        for name, values in zip(states[0], columns, strict=True)
    }
