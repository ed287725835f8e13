"""A wide one-hidden-layer model over the benchmark's MNIST images: `hidden` units make its size.

checkpoint_memory.py trains it to checkpoint a model with over 100 MB of state (values plus Adam's
two slots: 16,000 units are 12.6 M parameters, 151 MB of state).
"""

from __future__ import annotations

import keras


def build(hidden: int = 16000, num_classes: int = 10, input_name: str = "image") -> keras.Model:
    inputs = keras.Input(shape=(28, 28, 1), name=input_name)
    x = keras.layers.Dense(hidden, activation="relu")(keras.layers.Flatten()(inputs))
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="wide")
