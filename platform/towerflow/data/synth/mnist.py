"""Write the procedural digits as an MNIST-shaped TFRecord data set with a manifest.

The layout (``train-00000-of-00008`` ... , ``eval-...``, ``manifest.json``) is what the
readers expect from a real data set, so tests and demos exercise the same ingest path without
downloading anything. ``example_id`` is unique across both splits so that consumers can check
exactly-once delivery. ``eval_examples=0`` leaves the eval split out.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.data.synth.digits import NUM_CLASSES, SIZE, sample_digits
from towerflow.errors import TowerflowError

MANIFEST = "manifest.json"
_SHARD_NAME = re.compile(r"^(train|eval)-\d{5}-of-\d{5}$")

FEATURES: dict[str, dict[str, Any]] = {
    "image": {
        "dtype": "bytes",
        "shape": [],
        "decode": "uint8",
        "decoded_shape": [SIZE, SIZE, 1],
        "scale": 1.0 / 255.0,
    },
    "label": {"dtype": "int64", "shape": []},
    "example_id": {"dtype": "int64", "shape": []},
}


def shard_sizes(examples: int, shards: int) -> list[int]:
    """Split examples as evenly as possible: the first ``examples % shards`` shards get one more."""
    base, extra = divmod(examples, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def shard_names(split: str, shards: int) -> list[str]:
    return [f"{split}-{i:05d}-of-{shards:05d}" for i in range(shards)]


def _write_shard(path: Path, images: np.ndarray, labels: np.ndarray, ids: np.ndarray) -> None:
    import tensorflow as tf  # lazily: importing the package (CLI start-up) must not pay for TensorFlow

    # One Example is reused and mutated per record: building a fresh proto tree each time is
    # the slow part of writing, and the serialised bytes are identical either way.
    example = tf.train.Example()
    feature = example.features.feature
    image = feature["image"].bytes_list.value
    label = feature["label"].int64_list.value
    example_id = feature["example_id"].int64_list.value
    image.append(b"")
    label.append(0)
    example_id.append(0)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(len(labels)):
            image[0] = images[i].tobytes()
            label[0] = int(labels[i])
            example_id[0] = int(ids[i])
            writer.write(example.SerializeToString())


def _write_split(
    out: Path, split: str, n: int, shards: int, first_id: int, rng: np.random.Generator
) -> dict[str, Any]:
    images, labels = sample_digits(n, rng)
    ids = np.arange(first_id, first_id + n, dtype=np.int64)
    names, sizes = shard_names(split, shards), shard_sizes(n, shards)
    start = 0
    for name, size in zip(names, sizes, strict=True):
        stop = start + size
        _write_shard(out / name, images[start:stop], labels[start:stop], ids[start:stop])
        start = stop
    return {"pattern": f"{split}-*", "files": names, "examples": n, "per_file": sizes}


def _remove_stale(out: Path, keep: set[str]) -> None:
    """Drop the manifest and shards of an earlier run so ``train-*`` globs see only this one."""
    (out / MANIFEST).unlink(missing_ok=True)
    for path in out.iterdir():
        if _SHARD_NAME.match(path.name) and path.name not in keep:
            path.unlink()


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Atomic: a reader sees either no manifest or a complete one, never a half-written data set."""
    tmp = out / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)


def synth_mnist(
    out_dir: str | os.PathLike[str],
    *,
    shards: int = 8,
    examples: int = 60000,
    eval_examples: int = 10000,
    eval_shards: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Generate train and eval TFRecord shards of 28x28 digits into out_dir; return the manifest."""
    eval_shards = max(1, shards // 4) if eval_shards is None else eval_shards
    plan = {"train": (examples, shards, 0), "eval": (eval_examples, eval_shards, examples)}
    if not eval_examples:
        del plan["eval"]
    for name, (count, parts, _) in plan.items():
        if parts < 1 or count < parts:
            raise TowerflowError(
                f"synthetic {name} split: need at least one shard and one example per shard, "
                f"got {count} examples for {parts} shards"
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale(out, {f for name, (_, parts, _) in plan.items() for f in shard_names(name, parts)})
    # Independent child streams: the eval set never shares random draws with train.
    streams = dict(zip(("train", "eval"), np.random.SeedSequence(seed).spawn(2), strict=True))
    splits = {
        name: _write_split(out, name, count, parts, first_id, np.random.default_rng(streams[name]))
        for name, (count, parts, first_id) in plan.items()
    }
    manifest = {
        "name": "mnist",
        "format": "tfrecord",
        "generator": "towerflow data synth mnist",
        "seed": seed,
        "label": "label",
        "num_classes": NUM_CLASSES,
        "splits": splits,
        "features": copy.deepcopy(FEATURES),
    }
    _write_manifest(out, manifest)
    return manifest
