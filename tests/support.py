"""Helpers for tests: tiny real TFRecord data sets and small valid specs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf


def write_tfrecords(folder: Path, name: str, columns: dict[str, np.ndarray], shards: int) -> list[str]:
    """Write columns (int64 or float32 arrays, first axis = examples) as `name-0000i-of-0000n` shards."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(next(iter(columns.values())))
    bounds = np.linspace(0, n, shards + 1).astype(int)
    files = []
    for s in range(shards):
        path = folder / f"{name}-{s:05d}-of-{shards:05d}"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for i in range(bounds[s], bounds[s + 1]):
                feature = {}
                for key, col in columns.items():
                    value = np.asarray(col[i]).reshape(-1)
                    if col.dtype.kind in "iu":
                        feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=value.tolist()))
                    else:
                        feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=value.tolist()))
                writer.write(
                    tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
                )
        files.append(path.name)
    return files


def blobs(n: int, dim: int = 8, classes: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Linearly separable-ish Gaussian blobs with example ids."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2, size=(classes, dim)).astype(np.float32)
    labels = rng.integers(0, classes, size=n)
    x = centers[labels] + rng.normal(0, 1, size=(n, dim)).astype(np.float32)
    return {
        "x": x.astype(np.float32),
        "label": labels.astype(np.int64),
        "example_id": np.arange(n, dtype=np.int64),
    }


def blob_spec(folder: Path, **sections) -> dict:
    """A small valid raw spec over blob_data; keyword sections replace or extend the defaults."""
    spec = {
        "name": "blobs-test",
        "model": {
            "ref": "models.mlp:build",
            "params": {"input_dim": 8, "num_classes": 2, "hidden": [16], "seed": 1},
            "loss": "sparse_categorical_crossentropy",
            "from_logits": True,
            "metrics": ["accuracy"],
        },
        "data": {
            "train": {"paths": str(folder / "train-*")},
            "batch_size": 32,
            "epochs": 1,
            "shuffle_files": False,
        },
        "cluster": {"workers": 2, "ps": 2, "cpus_per_worker": 1, "cpus_per_ps": 0.5},
        "training": {"mode": "sync", "max_steps": 10, "optimizer": {"name": "sgd", "learning_rate": 0.1}},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec
