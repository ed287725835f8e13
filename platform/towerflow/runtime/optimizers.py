"""Build a Keras optimizer (and learning-rate schedule) from the spec, inside a shard's process.

Each shard owns one optimizer over its own variables, so slots live beside their variables and the
schedule's step is the shard's version (the global step).
"""

from __future__ import annotations

from typing import Any


def build_optimizer(optimizer: dict[str, Any]):
    """`optimizer` is `OptimizerSpec.model_dump()`; returns a `keras.optimizers.Optimizer`."""
    import keras

    lr = optimizer["learning_rate"]
    if isinstance(lr, dict):
        if lr["schedule"] == "exponential_decay":
            lr = keras.optimizers.schedules.ExponentialDecay(
                lr["initial_learning_rate"], lr["decay_steps"], lr["decay_rate"], staircase=lr["staircase"]
            )
        else:
            lr = lr["initial_learning_rate"]
    options = {
        k: v
        for k, v in optimizer.items()
        if k not in ("name", "learning_rate", "clip_global_norm") and v is not None
    }
    name = optimizer["name"]
    if name in ("sgd", "momentum"):
        return keras.optimizers.SGD(learning_rate=lr, **options)
    classes = {
        "adam": keras.optimizers.Adam,
        "adagrad": keras.optimizers.Adagrad,
        "rmsprop": keras.optimizers.RMSprop,
    }
    return classes[name](learning_rate=lr, **options)
