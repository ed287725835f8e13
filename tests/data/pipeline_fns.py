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
