"""The worker's side of ingest: its stream of batches, and the step from a Ray Data batch (a dict of
NumPy columns) to a model's inputs and labels.

A `WorkerStream` carries a worker's Ray Data split together with how to read it (prefetch, the
varlen features to pad or keep ragged, per-tower preprocessing), so the worker needs no data spec.
A bare `ray.data.DataIterator` works too (tests feed fixed splits that way).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from towerflow.errors import DataError

NOT_INPUTS = ("example_id",)


@dataclass
class StreamOptions:
    prefetch_batches: int = 2
    varlen: dict[str, dict[str, Any]] = field(default_factory=dict)  # name: {"ragged": bool, "default": ..}
    tower_preprocess: list[str] = field(default_factory=list)  # import refs: fn(features, training)


@dataclass
class WorkerStream:
    """One worker's split of the training data and how to iterate it."""

    iterator: Any  # ray.data.DataIterator
    options: StreamOptions = field(default_factory=StreamOptions)
    rows_before: int = 0  # rows of this split used before this stream's first (by a lost predecessor)

    def batches(
        self, *, batch_size: int, drop_last: bool, shuffle_buffer: int, seed: int
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches of `batch_size` examples; with drop_last the worker's last partial batch of the run
        is dropped; a seeded local shuffle buffer when shuffle_buffer > 0."""
        batches = self.iterator.iter_batches(
            batch_size=batch_size,
            batch_format="numpy",
            drop_last=drop_last,
            prefetch_batches=self.options.prefetch_batches,
            local_shuffle_buffer_size=shuffle_buffer or None,
            local_shuffle_seed=seed if shuffle_buffer else None,
        )
        return self._acknowledging(batches) if hasattr(self.iterator, "acknowledge") else iter(batches)

    def _acknowledging(self, batches: Any, every_s: float = 0.5) -> Iterator[dict[str, np.ndarray]]:
        """Tell the split which rows are used: a batch is, once the next one is asked for (its step
        is over). The split then lets go of those blocks and keeps only what a replacement needs."""
        used, told = self.rows_before, time.monotonic()
        for batch in batches:
            yield batch
            used += len(next(iter(batch.values()))) if batch else 0
            if time.monotonic() - told > every_s:
                self.iterator.acknowledge(used)
                told = time.monotonic()

    def taken_over(self, rows_before: int) -> WorkerStream:
        """The same split for a replacement worker, where the split can be taken over (see
        data/splits.py), `rows_before` rows of it used or handed over already; else the split as it
        is (a fixed iterator starts over)."""
        take = getattr(self.iterator, "taken_over", None)
        return WorkerStream(take(), self.options, rows_before) if take else self

    def leftover(self, used: int) -> list[Any]:
        """The rows this split gave out beyond the first `used` (a lost worker's unused batches)."""
        find = getattr(self.iterator, "leftover", None)
        return find(used) if find else []

    def close(self) -> None:
        """End every split of this data set now, where the split can (the data is re-planned)."""
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()


def as_stream(data: Any) -> WorkerStream:
    return data if isinstance(data, WorkerStream) else WorkerStream(data)


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
