"""Model builders that tests name in specs (`tests.runtime.model_fns:...`)."""

import keras


def unbuilt(units: int = 3) -> keras.Model:
    """A model without keras.Input: its variables do not exist until it is first called."""
    return keras.Sequential([keras.layers.Dense(units)])


def stopped_while_built(**_: object) -> keras.Model:
    """A builder stopped by Ctrl-C (SIGINT's KeyboardInterrupt) as it runs: at a run's export, say."""
    raise KeyboardInterrupt
