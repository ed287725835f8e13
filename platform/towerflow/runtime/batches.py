"""Turn a Ray Data batch (a dict of NumPy columns) into a model's inputs and labels."""

from __future__ import annotations

from typing import Any

import numpy as np

from towerflow.errors import DataError


class BatchAdapter:
    """Select the columns a model takes, by its Keras input names; scale raw-byte features to float.

    A model with one input may take the single remaining feature whatever its name.
    """

    def __init__(self, input_names: list[str], label: str, scales: dict[str, float] | None = None) -> None:
        self.input_names = list(input_names)
        self.label = label
        self.scales = dict(scales or {})

    def __call__(self, batch: dict[str, np.ndarray]) -> tuple[Any, np.ndarray]:
        if self.label not in batch:
            raise DataError(f"label column {self.label!r} is not in the data (columns: {', '.join(batch)})")
        labels = batch[self.label]
        features = {k: v for k, v in batch.items() if k != self.label}
        chosen = {}
        for name in self.input_names:
            if name in features:
                chosen[name] = self._convert(name, features[name])
        if len(chosen) == len(self.input_names):
            return (chosen[self.input_names[0]] if len(chosen) == 1 else chosen), labels
        candidates = [k for k in features if k not in ("example_id",)]
        if len(self.input_names) == 1 and len(candidates) == 1:
            return self._convert(candidates[0], features[candidates[0]]), labels
        missing = [n for n in self.input_names if n not in features]
        raise DataError(
            f"the model's input(s) {missing} have no matching feature in the data "
            f"(features: {', '.join(features)}); name the model's keras.Input after a feature"
        )

    def _convert(self, name: str, column: np.ndarray) -> np.ndarray:
        scale = self.scales.get(name)
        if scale is None:
            return column
        return column.astype(np.float32) * np.float32(scale)
