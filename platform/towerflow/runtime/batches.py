"""The worker's side of ingest: a lost worker's unused rows as batches, and the step from a Ray
Data batch (a dict of NumPy columns) to a model's inputs and labels. The stream itself
(`WorkerStream`) is a shared type (towerflow/shared_types.py): data/ builds it, the worker reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from towerflow.errors import DataError
from towerflow.shared_types import NOT_INPUTS


def leftover_batches(leftover: list[Any], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Batches of the rows a lost worker had received and not used (data/splits.Leftover pieces),
    in order; the last may be short. Read by its replacement before the split itself."""
    import ray
    from ray.data.block import BlockAccessor

    pending: list[dict[str, np.ndarray]] = []
    held = 0
    for piece in leftover:
        block = BlockAccessor.for_block(ray.get(piece.block)).slice(piece.start, piece.stop, copy=False)
        pending.append(BlockAccessor.for_block(block).to_batch_format("numpy"))
        held += piece.rows
        while held >= batch_size:
            joined = {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
            yield {k: v[:batch_size] for k, v in joined.items()}
            pending, held = [{k: v[batch_size:] for k, v in joined.items()}], held - batch_size
    if held:
        yield {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}


class BatchAdapter:
    """Select the columns a model takes, by its Keras input names; scale raw-byte features to float;
    pad varlen features to the batch's longest record, or make them tf.RaggedTensors.

    A model with one input may take the single remaining feature whatever its name. The label and
    `example_id` are never inputs.
    """

    def __init__(
        self,
        input_names: list[str],
        label: str,
        scales: dict[str, float] | None = None,
        varlen: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.input_names = list(input_names)
        self.label = label
        self.scales = dict(scales or {})
        self.varlen = dict(varlen or {})

    def __call__(self, batch: dict[str, np.ndarray]) -> tuple[Any, np.ndarray]:
        if self.label not in batch:
            raise DataError(f"label column {self.label!r} is not in the data (columns: {', '.join(batch)})")
        labels = batch[self.label]
        features = {k: v for k, v in batch.items() if k != self.label and k not in NOT_INPUTS}
        chosen = {}
        for name in self.input_names:
            if name in features:
                chosen[name] = self._convert(name, features[name])
        if len(chosen) == len(self.input_names):
            return (chosen[self.input_names[0]] if len(chosen) == 1 else chosen), labels
        if len(self.input_names) == 1 and len(features) == 1:
            (name,) = features
            return self._convert(name, features[name]), labels
        missing = [n for n in self.input_names if n not in features]
        raise DataError(
            f"the model's input(s) {missing} have no matching feature in the data "
            f"(features: {', '.join(features)}); name the model's keras.Input after a feature or group"
        )

    def _convert(self, name: str, column: np.ndarray) -> Any:
        if name in self.varlen:
            return self._varlen(column, self.varlen[name])
        scale = self.scales.get(name)
        if scale is None:
            return column
        return column.astype(np.float32) * np.float32(scale)

    @staticmethod
    def _varlen(column: np.ndarray, how: dict[str, Any]) -> Any:
        rows = list(column)
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        values = np.concatenate(rows) if rows else np.empty(0)
        if how.get("ragged"):
            import tensorflow as tf

            return tf.RaggedTensor.from_row_lengths(values, lengths)
        width = int(lengths.max()) if len(lengths) else 0
        default = how.get("default")
        if default is None:
            default = b"" if values.dtype == object else 0
        dense = np.full((len(rows), width), default, dtype=values.dtype)
        dense[np.arange(width) < lengths[:, None]] = values
        return dense


class TowerModel:
    """The model with per-tower preprocessing in front: fn(features, training) -> features, in order,
    inside the tower (on its device, in the traced step) before the forward pass."""

    def __init__(self, model: Any, refs: list[str]) -> None:
        from towerflow.imports import import_ref

        self.model = model
        self.functions = [import_ref(ref, key="data.train.tower_preprocess") for ref in refs]

    def __call__(self, inputs: Any, training: bool = False) -> Any:
        for fn in self.functions:
            inputs = fn(inputs, training)
        return self.model(inputs, training=training)

    @property
    def trainable_variables(self):
        return self.model.trainable_variables

    @property
    def losses(self):
        return self.model.losses
