"""Word-level LSTM language model as in TensorFlow's PTB tutorial ("small" config by default).

Input: int word ids [batch, steps] named `inputs`; output: logits [batch, steps, vocab_size] for
the next word at every position (train with sparse_categorical_crossentropy, from_logits).
Weights start uniform in [-init_scale, init_scale] as in the tutorial; `seed` makes them the same
in every process. The tutorial's small config: 2 layers of 200 units, no dropout.
"""

from __future__ import annotations

import keras


def build(
    vocab_size: int = 10_000,
    embed: int = 200,
    hidden: int = 200,
    num_layers: int = 2,
    steps: int = 35,
    dropout: float = 0.0,
    init_scale: float = 0.1,
    input_name: str = "inputs",
    seed: int | None = None,
) -> keras.Model:
    def init(offset: int) -> keras.initializers.Initializer:
        return keras.initializers.RandomUniform(
            -init_scale, init_scale, seed=None if seed is None else seed + offset
        )

    inputs = keras.Input(shape=(steps,), dtype="int64", name=input_name)
    x = keras.layers.Embedding(vocab_size, embed, embeddings_initializer=init(0), name="embedding")(inputs)
    if dropout:
        x = keras.layers.Dropout(dropout)(x)
    for layer in range(num_layers):
        x = keras.layers.LSTM(
            hidden,
            return_sequences=True,
            kernel_initializer=init(2 * layer + 1),
            recurrent_initializer=init(2 * layer + 2),
            name=f"lstm_{layer}",
        )(x)
        if dropout:
            x = keras.layers.Dropout(dropout)(x)
    logits = keras.layers.Dense(vocab_size, kernel_initializer=init(2 * num_layers + 1), name="logits")(x)
    return keras.Model(inputs, logits, name="ptb_lstm")
