"""LeNet as in TensorFlow's classic "Deep MNIST" tutorial: conv 32@5x5, pool, conv 64@5x5, pool,
dense 1024, dense num_classes (logits)."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def build(
    num_classes: int = 10, input_name: str = "image", dropout: float = 0.0, keras: ModuleType | None = None
) -> Any:
    """`keras`: the Keras to build with (default Keras 3; the peers benchmark passes tf_keras)."""
    if keras is None:
        import keras
    inputs = keras.Input(shape=(28, 28, 1), name=input_name)
    x = keras.layers.Conv2D(32, 5, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(64, 5, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(1024, activation="relu")(x)
    if dropout:
        x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="lenet")
