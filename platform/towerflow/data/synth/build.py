"""Turn a synthetic data set definition into train/eval shards and a manifest, in either format.

A definition (mnist, ptb, tabular) only says what its examples look like; this module owns the
layout every synthetic data set shares: a seed split into independent train and eval streams,
examples generated in fixed-size chunks (so neither the shard count nor the format changes them),
`example_id` unique across both splits, the stale-file clean-up and the manifest.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from towerflow.data.synth.shards import (
    CSV_OPTIONS,
    Progress,
    SplitWriter,
    check_plan,
    remove_stale,
    shard_names,
    shard_sizes,
    write_manifest,
)
from towerflow.errors import SpecError

ID = "example_id"
_ID_FEATURE = {"dtype": "int64", "shape": []}


class Definition(Protocol):
    """What one synthetic data set provides; `build.synthesize` does the rest."""

    name: str
    label: str

    def features(self, fmt: str) -> dict[str, dict[str, Any]]:
        """Manifest feature spec for the format, without example_id (for CSV: every column, in order)."""

    def chunks(self, examples: int, rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
        """Yield exactly `examples` examples as TFRecord-shaped columns, in chunks of any size."""

    def to_csv(self, chunk: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The chunk as 1-D columns named as in `features("csv")`."""

    def manifest_keys(self) -> dict[str, Any]:
        """Data-set specific manifest keys (num_classes, vocab_size, ...)."""


def synthesize(
    definition: Definition,
    out_dir: str | os.PathLike[str],
    *,
    shards: int,
    examples: int,
    eval_examples: int,
    eval_shards: int | None,
    fmt: str,
    seed: int,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the train (and, unless eval_examples is 0, eval) split; return the manifest."""
    eval_shards = max(1, shards // 4) if eval_shards is None else eval_shards
    plan = {"train": (examples, shards)}
    if eval_examples:
        plan["eval"] = (eval_examples, eval_shards)
    check_plan(fmt, plan)
    if seed < 0:
        raise SpecError(f"synthetic data: seed must be a non-negative integer, got {seed}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale(out, {f for split, (_, parts) in plan.items() for f in shard_names(split, parts, fmt)})

    features = {ID: dict(_ID_FEATURE), **copy.deepcopy(definition.features(fmt))}
    keys = definition.manifest_keys()
    counts_classes = "num_classes" in keys
    # Independent child streams: the eval set never shares random draws with train.
    streams = dict(zip(("train", "eval"), np.random.SeedSequence(seed).spawn(2), strict=True))
    splits, class_counts, first_id = {}, {}, 0
    for split, (count, parts) in plan.items():
        per_file = shard_sizes(count, parts)
        writer = SplitWriter(out, split, per_file, fmt, features, progress)
        counts = np.zeros(keys.get("num_classes", 0), dtype=np.int64)
        next_id = first_id
        try:
            for chunk in definition.chunks(count, np.random.default_rng(streams[split])):
                rows = len(chunk[definition.label])
                if counts_classes:
                    counts += np.bincount(chunk[definition.label], minlength=counts.size)
                row = definition.to_csv(chunk) if fmt == "csv" else dict(chunk)
                writer.write({ID: np.arange(next_id, next_id + rows, dtype=np.int64), **row})
                next_id += rows
        except BaseException:
            writer.close(complete=False)
            raise
        writer.close()
        splits[split] = {
            "pattern": f"{split}-*",
            "files": writer.files,
            "examples": count,
            "per_file": per_file,
        }
        class_counts[split] = counts.tolist()
        first_id += count

    manifest: dict[str, Any] = {
        "name": definition.name,
        "format": fmt,
        "generator": f"towerflow data synth {definition.name}",
        "seed": seed,
        "label": definition.label,
    }
    if fmt == "csv":
        manifest["csv"] = dict(CSV_OPTIONS)
    manifest |= {"splits": splits, "features": features, **keys}
    if counts_classes:
        manifest["class_counts"] = class_counts
    write_manifest(out, manifest)
    return manifest
