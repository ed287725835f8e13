"""A tabular classification data set: 30 numeric features, one categorical feature, optional imbalance.

Labels come first, drawn from the class priors (with `imbalance=r` the last class, the positive
or minority one, has prior r and the others share the rest). Given the label:
- 8 informative features are Gaussian around a class mean, 8 are noisy linear mixtures of them
  (correlated, redundant), 14 are pure noise; then the columns are shuffled and each gets its own
  scale and offset, as real tables do;
- `category` (an id in [0, num_categories)) is drawn from a per-class distribution, so it carries
  information of its own, independent of the numeric features.
The structure (means, mixtures, category tables) follows from the seed and is shared by the train
and eval splits. A linear model does well; the Bayes error is not zero.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from towerflow.data.synth.build import synthesize
from towerflow.data.synth.shards import Progress
from towerflow.errors import SpecError

NUM_FEATURES = 30
FEATURES = [f"f{i:02d}" for i in range(NUM_FEATURES)]
_INFORMATIVE, _REDUNDANT = 8, 8
_SEPARATION = 0.5  # scale of the class means in the informative space (unit noise)
_CHUNK = 8192


def class_priors(num_classes: int, imbalance: float | None) -> np.ndarray:
    """Uniform, or the last class at `imbalance` and the others sharing the rest equally."""
    if num_classes < 2:
        raise SpecError(f"tabular: num_classes must be at least 2, got {num_classes}")
    if imbalance is None:
        return np.full(num_classes, 1.0 / num_classes)
    if not 0.0 < imbalance < 1.0:
        raise SpecError(f"tabular: --imbalance is the minority class fraction, in (0, 1); got {imbalance}")
    rest = (1.0 - imbalance) / (num_classes - 1)
    return np.array([rest] * (num_classes - 1) + [imbalance])


class TabularDefinition:
    name = "tabular"
    label = "label"

    def __init__(
        self, seed: int, num_classes: int = 2, num_categories: int = 8, imbalance: float | None = None
    ):
        if num_categories < 1:
            raise SpecError(f"tabular: num_categories must be at least 1, got {num_categories}")
        self.priors = class_priors(num_classes, imbalance)
        self.num_classes, self.num_categories, self.imbalance = num_classes, num_categories, imbalance
        # Its own stream (the build module spawns children 0 and 1 for train and eval).
        rng = np.random.default_rng(np.random.SeedSequence(max(seed, 0), spawn_key=(2,)))
        self._means = rng.normal(0.0, _SEPARATION, size=(num_classes, _INFORMATIVE))
        self._mixing = rng.normal(0.0, 1.0 / np.sqrt(_INFORMATIVE), size=(_INFORMATIVE, _REDUNDANT))
        self._category_probs = rng.dirichlet(np.full(num_categories, 0.3), size=num_classes)
        self._order = rng.permutation(NUM_FEATURES)
        self._scale = np.exp(rng.uniform(-1.0, 1.5, NUM_FEATURES))
        self._offset = rng.normal(0.0, 2.0, NUM_FEATURES)

    def features(self, fmt: str) -> dict[str, dict[str, Any]]:
        numeric = {name: {"dtype": "float32", "shape": []} for name in FEATURES}
        return {
            **numeric,
            "category": {"dtype": "int64", "shape": []},
            "label": {"dtype": "int64", "shape": []},
        }

    def chunks(self, examples: int, rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, examples, _CHUNK):
            n = min(_CHUNK, examples - start)
            labels = rng.choice(self.num_classes, size=n, p=self.priors)
            informative = self._means[labels] + rng.normal(size=(n, _INFORMATIVE))
            redundant = informative @ self._mixing + rng.normal(0.0, 0.3, size=(n, _REDUNDANT))
            noise = rng.normal(size=(n, NUM_FEATURES - _INFORMATIVE - _REDUNDANT))
            x = np.concatenate([informative, redundant, noise], axis=1)[:, self._order]
            x = (x * self._scale + self._offset).astype(np.float32)
            # Inverse-CDF draw per row from its class's category distribution.
            cdf = np.cumsum(self._category_probs[labels], axis=1)
            category = (rng.random((n, 1)) * cdf[:, -1:] > cdf).sum(axis=1)
            columns = {name: x[:, i] for i, name in enumerate(FEATURES)}
            yield {**columns, "category": category.astype(np.int64), "label": labels.astype(np.int64)}

    def to_csv(self, chunk: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return chunk  # already one scalar column per feature, in manifest order

    def manifest_keys(self) -> dict[str, Any]:
        informative = [FEATURES[j] for j in np.flatnonzero(self._order < _INFORMATIVE)]
        return {
            "num_classes": self.num_classes,
            "num_categories": self.num_categories,
            "imbalance": self.imbalance,
            "class_priors": self.priors.tolist(),
            "numeric_features": f"{FEATURES[0]}..{FEATURES[-1]}",
            "informative_features": informative,
        }


def synth_tabular(
    out_dir: str | os.PathLike[str],
    *,
    shards: int = 8,
    examples: int = 50_000,
    eval_examples: int = 10_000,
    eval_shards: int | None = None,
    seed: int = 0,
    fmt: str = "tfrecord",
    num_classes: int = 2,
    num_categories: int = 8,
    imbalance: float | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Generate the tabular classification set in TFRecord (one scalar feature per column) or CSV."""
    return synthesize(
        TabularDefinition(seed, num_classes, num_categories, imbalance),
        out_dir,
        shards=shards,
        examples=examples,
        eval_examples=eval_examples,
        eval_shards=eval_shards,
        fmt=fmt,
        seed=seed,
        progress=progress,
    )
