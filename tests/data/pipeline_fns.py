"""Small preprocessing functions that tests name in specs (`tests.data.pipeline_fns:...`)."""

from __future__ import annotations

import numpy as np


def keep_even_ids(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per batch, in Ray Data: drop the examples with odd ids."""
    keep = batch["example_id"] % 2 == 0
    return {name: column[keep] for name, column in batch.items()}


def zero_inputs_when_training(features, training: bool):
    """Per tower, in TensorFlow: the model sees zeros while training (so its first kernel gets no gradient)."""
    import tensorflow as tf

    return tf.zeros_like(features) if training else features


def add_one(features, training: bool):
    return features + 1.0


def mean_of_ids(ragged: bool = False):
    """A model over one variable-length int64 feature `ids` (ragged, or padded with -1)."""
    import keras
    import tensorflow as tf

    inputs = keras.Input(shape=(None,), ragged=ragged, dtype="int64", name="ids")

    def mean(t):
        if isinstance(t, tf.RaggedTensor):
            return tf.reduce_mean(tf.cast(t, tf.float32), axis=1, keepdims=True)
        valid = tf.cast(t >= 0, tf.float32)
        return tf.reduce_sum(tf.cast(t, tf.float32) * valid, 1, keepdims=True) / tf.reduce_sum(
            valid, 1, keepdims=True
        )

    hidden = keras.layers.Lambda(mean, output_shape=(1,))(inputs)
    outputs = keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(seed=0))(hidden)
    return keras.Model(inputs, outputs)
