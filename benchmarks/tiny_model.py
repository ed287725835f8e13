"""A model with next to no variables over the benchmark's MNIST images (7,850 parameters).

throughput.py trains it to measure a parameter-server shard's fixed memory (TensorFlow, towerflow's
code, the optimizer's traced functions, Ray's actor machinery): what a shard costs whatever it holds.
"""

from __future__ import annotations

import keras


def build(num_classes: int = 10, input_name: str = "image") -> keras.Model:
    inputs = keras.Input(shape=(28, 28, 1), name=input_name)
    outputs = keras.layers.Dense(num_classes, name="logits")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, outputs, name="tiny")
