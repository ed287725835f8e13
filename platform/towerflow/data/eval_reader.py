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

from towerflow.data.ingest import ShardReader, prepare_split


@dataclass
class EvalSource:
    files: list[str]
    reader: ShardReader
    varlen: dict[str, dict[str, Any]] = field(default_factory=dict)
    tower_preprocess: list[str] = field(default_factory=list)


def eval_source(spec: Any) -> EvalSource:
    """The spec's `data.eval`, resolved the way training data is (errors name `data.eval...`), its
    bad records handled as `data.on_bad_record` says (skipped ones are logged per file)."""
    source = spec.data.eval
    split = prepare_split(source, "data.eval", spec.data.on_bad_record)
    return EvalSource(split.files, split.reader, split.varlen, list(source.tower_preprocess))


def iter_eval_batches(
    files: list[str], reader: ShardReader, batch_size: int
) -> Iterator[dict[str, np.ndarray]]:
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
