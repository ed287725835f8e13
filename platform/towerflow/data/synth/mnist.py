"""Synthetic MNIST: procedurally drawn digits written as TFRecord shards plus a manifest.

Records are `tf.train.Example`s with `image` (784 raw uint8 bytes), `label` (int64) and
`example_id` (int64, unique across train and eval, for exactly-once checks). The manifest is
written last, atomically, so a half-written data set has none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.data.synth.digits import sample_digits

FEATURES: dict[str, dict[str, Any]] = {
    "image": {
        "dtype": "bytes",
        "shape": [],
        "decode": "uint8",
        "decoded_shape": [28, 28, 1],
        "scale": 1 / 255,
    },
    "label": {"dtype": "int64", "shape": []},
    "example_id": {"dtype": "int64", "shape": []},
}


def synth_mnist(
    out_dir: str | os.PathLike,
    *,
    shards: int = 8,
    examples: int = 60000,
    eval_examples: int = 10000,
    eval_shards: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Write train and eval shards into `out_dir`; return the manifest (also written as manifest.json)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_rng, eval_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    splits = {"train": _write_split(out, "train", examples, shards, train_rng, first_id=0)}
    if eval_examples:
        eval_shards = eval_shards or max(1, shards // 4)
        splits["eval"] = _write_split(out, "eval", eval_examples, eval_shards, eval_rng, first_id=examples)
    manifest = {
        "name": "mnist",
        "format": "tfrecord",
        "generator": "towerflow data synth mnist",
        "seed": seed,
        "label": "label",
        "num_classes": 10,
        "splits": splits,
        "features": FEATURES,
    }
    tmp = out / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / "manifest.json")
    return manifest


def _write_split(out: Path, name: str, count: int, shards: int, rng: np.random.Generator, first_id: int):
    import tensorflow as tf

    bounds = np.linspace(0, count, shards + 1).astype(int)
    files, per_file = [], []
    for shard, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        images, labels = sample_digits(int(stop - start), rng)
        filename = f"{name}-{shard:05d}-of-{shards:05d}"
        with tf.io.TFRecordWriter(str(out / filename)) as writer:
            for offset, (image, label) in enumerate(zip(images, labels)):
                writer.write(_example(tf, image.tobytes(), int(label), first_id + int(start) + offset))
        files.append(filename)
        per_file.append(int(stop - start))
    return {"pattern": f"{name}-*", "files": files, "examples": count, "per_file": per_file}


def _example(tf, image: bytes, label: int, example_id: int) -> bytes:
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
        "example_id": tf.train.Feature(int64_list=tf.train.Int64List(value=[example_id])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
