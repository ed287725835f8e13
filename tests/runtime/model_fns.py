"""Model builders that tests name in specs (`tests.runtime.model_fns:...`)."""

import keras


def unbuilt(units: int = 3) -> keras.Model:
    """A model without keras.Input: its variables do not exist until it is first called."""
    return keras.Sequential([keras.layers.Dense(units)])


def stopped_while_built(**_: object) -> keras.Model:
    """A builder stopped by Ctrl-C (SIGINT's KeyboardInterrupt) as it runs: at a run's export, say."""
    raise KeyboardInterrupt


def nan_gradients(input_dim: int = 8, num_classes: int = 2, **_: object) -> keras.Model:
    """A finite loss with NaN gradients: sqrt(0) adds nothing to the outputs, and its derivative
    (1 / 0, times 0) is NaN, which reaches every weight."""
    inputs = keras.Input((input_dim,))
    logits = keras.layers.Dense(num_classes)(inputs)
    zero = keras.ops.sqrt(keras.ops.sum(keras.ops.square(logits - logits), axis=-1, keepdims=True))
    return keras.Model(inputs, logits + zero)
