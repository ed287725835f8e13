"""The procedural digits as an MNIST-shaped data set (TFRecord or CSV shards with a manifest).

The layout (``train-00000-of-00008`` ... , ``eval-...``, ``manifest.json``) is what the
readers expect from a real data set, so tests and demos exercise the same ingest path without
downloading anything. TFRecord: ``image`` holds the 784 raw uint8 bytes. CSV: columns
``example_id, label, px000..px783`` (row-major 28x28 pixels as integers 0-255).
``eval_examples=0`` leaves the eval split out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from towerflow.data.synth.build import synthesize
from towerflow.data.synth.digits import NUM_CLASSES, SIZE, sample_digits
from towerflow.data.synth.shards import Progress

CHUNK = 4096  # examples drawn per step: fixed, so the shard count never changes the data
PIXELS = [f"px{i:03d}" for i in range(SIZE * SIZE)]

FEATURES: dict[str, dict[str, Any]] = {
    "image": {
        "dtype": "bytes",
        "shape": [],
        "decode": "uint8",
        "decoded_shape": [SIZE, SIZE, 1],
        "scale": 1.0 / 255.0,
    },
    "label": {"dtype": "int64", "shape": []},
}


class MnistDefinition:
    name = "mnist"
    label = "label"

    def __init__(self, fmt: str):
        self._fmt = fmt

    def features(self, fmt: str) -> dict[str, dict[str, Any]]:
        if fmt == "csv":
            scalar = {"dtype": "int64", "shape": []}
            return {"label": dict(scalar), **{name: dict(scalar) for name in PIXELS}}
        return FEATURES

    def chunks(self, examples: int, rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, examples, CHUNK):
            images, labels = sample_digits(min(CHUNK, examples - start), rng)
            yield {"image": images, "label": labels}

    def to_csv(self, chunk: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = chunk["image"].reshape(len(chunk["image"]), -1).astype(np.int64)
        return {"label": chunk["label"], **{name: pixels[:, i] for i, name in enumerate(PIXELS)}}

    def manifest_keys(self) -> dict[str, Any]:
        keys: dict[str, Any] = {"num_classes": NUM_CLASSES}
        if self._fmt == "csv":
            keys["image_columns"] = {
                "columns": "px000..px783",
                "shape": [SIZE, SIZE, 1],
                "scale": 1.0 / 255.0,
                "note": "row-major 28x28 pixels, uint8 values written as integers; group px* into `image`",
            }
        return keys


def synth_mnist(
    out_dir: str | os.PathLike[str],
    *,
    shards: int = 8,
    examples: int = 60000,
    eval_examples: int = 10000,
    eval_shards: int | None = None,
    seed: int = 0,
    fmt: str = "tfrecord",
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Generate train and eval shards of 28x28 digits into out_dir; return the manifest."""
    return synthesize(
        MnistDefinition(fmt),
        out_dir,
        shards=shards,
        examples=examples,
        eval_examples=eval_examples,
        eval_shards=eval_shards,
        fmt=fmt,
        seed=seed,
        progress=progress,
    )
