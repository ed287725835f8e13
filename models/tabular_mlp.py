"""An MLP for tabular data: a dense numeric vector `x` plus one categorical id through an embedding.

Inputs (matching the data spec's names): `x` float32 [num_features] (the numeric columns grouped
into one tensor) and `category` int64 [] in [0, num_categories). Give `mean` and `variance` (per
feature, e.g. from the training split) to standardise `x` with fixed constants rather than
statistics learnt during training. `pipelines/tabular_csv.yaml` trains it from CSV shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras


def build(
    num_features: int = 30,
    num_categories: int = 8,
    num_classes: int = 2,
    embed: int = 4,
    hidden: Sequence[int] = (64, 32),
    mean: Sequence[float] | None = None,
    variance: Sequence[float] | None = None,
    numeric_name: str = "x",
    category_name: str = "category",
    seed: int | None = None,
) -> keras.Model:
    def init(offset: int) -> keras.initializers.Initializer:
        return keras.initializers.GlorotUniform(seed=None if seed is None else seed + offset)

    numeric = keras.Input(shape=(num_features,), name=numeric_name)
    category = keras.Input(shape=(), dtype="int64", name=category_name)
    x = numeric
    if (mean is None) != (variance is None):
        raise ValueError("tabular_mlp: give both mean and variance, or neither")
    if mean is not None:
        x = keras.layers.Normalization(mean=list(mean), variance=list(variance), name="standardize")(x)
    embedded = keras.layers.Embedding(
        num_categories,
        embed,
        embeddings_initializer=keras.initializers.RandomUniform(-0.05, 0.05, seed=seed),
        name="category_embedding",
    )(category)
    x = keras.layers.Concatenate()([x, embedded])
    for i, units in enumerate(hidden):
        x = keras.layers.Dense(units, activation="relu", kernel_initializer=init(i + 1))(x)
    logits = keras.layers.Dense(num_classes, kernel_initializer=init(len(hidden) + 1), name="logits")(x)
    return keras.Model({numeric_name: numeric, category_name: category}, logits, name="tabular_mlp")
