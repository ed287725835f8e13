"""Evaluation data: read a split's files in order, in batches of a given size, without Ray Data.

Evaluation sets are small and read whole by one evaluator actor, every evaluation, in the same
order (so two evaluations of the same parameters give the same figures).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from towerflow.data.tfrecord import read_tfrecord_file


def iter_eval_batches(
    files: list[str], features: dict[str, dict[str, Any]], batch_size: int
) -> Iterator[dict[str, np.ndarray]]:
    pending: list[dict[str, np.ndarray]] = []
    held = 0
    for path in files:
        for chunk in read_tfrecord_file(path, features):
            pending.append(chunk)
            held += len(next(iter(chunk.values())))
            while held >= batch_size:
                joined = {k: np.concatenate([c[k] for c in pending]) for k in pending[0]}
                yield {k: v[:batch_size] for k, v in joined.items()}
                rest = {k: v[batch_size:] for k, v in joined.items()}
                held -= batch_size
                pending = [rest] if held else []
    if held:
        yield {k: np.concatenate([c[k] for c in pending]) for k in pending[0]}
