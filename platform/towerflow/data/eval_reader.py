"""Evaluation data: a split's files read in order, in batches of a given size, without Ray Data.

Evaluation sets are small and read whole by one evaluator actor, every evaluation, in the same
order (so two evaluations of the same parameters give the same figures). The files go through the
same ShardReader as training data (TFRecord or CSV, groups, per-batch preprocessing).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from towerflow.data.features import ColumnPlan, expand_groups
from towerflow.data.infer import resolve_features
from towerflow.data.ingest import ShardReader, csv_layout
from towerflow.data.sources import read_manifest, resolve_files


@dataclass
class EvalSource:
    files: list[str]
    reader: ShardReader
    varlen: dict[str, dict[str, Any]] = field(default_factory=dict)
    tower_preprocess: list[str] = field(default_factory=list)


def eval_source(spec: Any) -> EvalSource:
    """The spec's `data.eval`, resolved the way training data is (errors name `data.eval...`)."""
    source = spec.data.eval
    files = resolve_files(source.path_list, key="data.eval.paths")
    manifest = read_manifest(files)
    layout = csv_layout(source, manifest)
    features = resolve_features(source, files, manifest, layout, key="data.eval")
    groups = expand_groups(source.groups, features, source.label)
    plan = ColumnPlan(features, groups, list(source.preprocess))
    reader = ShardReader(source.format, features, plan, layout, "error")
    varlen = {
        n: {"ragged": f["ragged"], "default": f["default"]}
        for n, f in features.items()
        if f["varlen"] and not f["pad_to"]
    }
    return EvalSource(files, reader, varlen, list(source.tower_preprocess))


def iter_eval_batches(files: list[str], reader: ShardReader, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    pending: list[dict[str, np.ndarray]] = []
    held = 0
    for path in files:
        for chunk in reader(path):
            pending.append(chunk)
            held += len(next(iter(chunk.values())))
            while held >= batch_size:
                joined = {k: np.concatenate([c[k] for c in pending]) for k in pending[0]}
                yield {k: v[:batch_size] for k, v in joined.items()}
                held -= batch_size
                pending = [{k: v[batch_size:] for k, v in joined.items()}] if held else []
    if held:
        yield {k: np.concatenate([c[k] for c in pending]) for k in pending[0]}
