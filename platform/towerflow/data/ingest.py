"""Build the training stream: shard files -> Ray Data parse tasks -> one stream per worker.

Epochs are laid out as one pass over the file list repeated (re-shuffled per epoch), so the whole
run is a single Ray Data execution: no barrier between workers at epoch boundaries, and parse
processes (with TensorFlow imported) stay warm for the whole run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from towerflow.data.sources import example_count, feature_spec, resolve_files
from towerflow.data.tfrecord import read_tfrecord_file
from towerflow.errors import DataError

UNBOUNDED_EPOCHS = 1000  # data.epochs: null with an unknown data set size


@dataclass
class TrainingData:
    splits: list[Any]  # ray.data.DataIterator, one per worker
    features: dict[str, dict[str, Any]]
    feature_scales: dict[str, float]
    files: list[str]
    epochs: int
    examples_per_epoch: int | None


def build_training_data(spec: Any, num_workers: int) -> TrainingData:
    import ray

    source = spec.data.train
    files = resolve_files(source.path_list, key="data.train.paths")
    features = feature_spec(source, files, key="data.train")
    if source.label not in features:
        raise DataError(
            f"data.train.label: {source.label!r} is not a feature of the data (features: {', '.join(features)})"
        )
    per_epoch = example_count(files)
    epochs = spec.data.epochs or _epochs_for_steps(spec, per_epoch, num_workers)
    ordered = epoch_file_order(files, epochs, shuffle=spec.data.shuffle_files, seed=spec.data.seed)
    ds = ray.data.from_items([{"path": p} for p in ordered], override_num_blocks=len(ordered))
    ds = ds.map_batches(parse_files, batch_size=1, fn_kwargs={"features": features}, num_cpus=1)
    # Sync: every worker gets the same number of examples (equal). Async: faster workers take more.
    splits = ds.streaming_split(num_workers, equal=spec.training.mode == "sync")
    scales = {name: f["scale"] for name, f in features.items() if f.get("scale") is not None}
    return TrainingData(splits, features, scales, files, epochs, per_epoch)


def parse_files(batch: dict[str, Any], features: dict[str, dict[str, Any]]):
    """Ray Data map_batches function: a batch of file paths in, parsed column batches out."""
    for path in batch["path"]:
        yield from read_tfrecord_file(str(path), features)


def epoch_file_order(files: list[str], epochs: int, *, shuffle: bool, seed: int) -> list[str]:
    order: list[str] = []
    for epoch in range(epochs):
        files_this_epoch = list(files)
        if shuffle:
            random.Random(seed * 100_003 + epoch).shuffle(files_this_epoch)
        order.extend(files_this_epoch)
    return order


def _epochs_for_steps(spec: Any, per_epoch: int | None, num_workers: int) -> int:
    if per_epoch is None or not spec.training.max_steps:
        return UNBOUNDED_EPOCHS
    needed = spec.training.max_steps * spec.data.batch_size * num_workers
    return max(1, math.ceil(needed / per_epoch)) + 1
