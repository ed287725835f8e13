"""A small multilayer perceptron over one dense feature vector.

`seed` fixes the initial weights independently of any global random state, so the same build
gives the same model in every process (tests compare distributed runs to one process with it).
`batch_norm` adds a BatchNormalization after each hidden layer.
"""

from __future__ import annotations

import keras


def build(
    input_dim: int,
    num_classes: int = 2,
    hidden: list[int] | tuple[int, ...] = (32,),
    input_name: str = "x",
    l2: float = 0.0,
    seed: int | None = None,
    batch_norm: bool = False,
) -> keras.Model:
    regularizer = keras.regularizers.L2(l2) if l2 else None
    inputs = keras.Input(shape=(input_dim,), name=input_name)
    x = inputs
    for i, units in enumerate(hidden):
        x = keras.layers.Dense(
            units,
            activation="relu",
            kernel_initializer=keras.initializers.GlorotUniform(seed=None if seed is None else seed + i),
            kernel_regularizer=regularizer,
        )(x)
        if batch_norm:  # moving statistics: non-trainable state the workers keep, not the shards
            x = keras.layers.BatchNormalization(momentum=0.5)(x)
    outputs = keras.layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.GlorotUniform(
            seed=None if seed is None else seed + len(hidden)
        ),
        name="logits",
    )(x)
    return keras.Model(inputs, outputs, name="mlp")
