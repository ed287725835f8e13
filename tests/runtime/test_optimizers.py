"""Shard optimizers are Keras optimizers built from the spec; the schedule's step is the shard version."""

import numpy as np
import pytest
import tensorflow as tf

from towerflow.runtime.optimizers import build_optimizer
from towerflow.spec import OptimizerSpec


@pytest.mark.parametrize(
    "config",
    [
        {"name": "sgd", "learning_rate": 0.1},
        {"name": "momentum", "learning_rate": 0.1, "momentum": 0.5, "nesterov": True},
        {"name": "adam", "learning_rate": 0.01, "beta_1": 0.8},
        {"name": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.2},
        {"name": "rmsprop", "learning_rate": 0.01, "rho": 0.8, "centered": True},
    ],
)
def test_every_optimizer_updates_variables(config):
    optimizer = build_optimizer(OptimizerSpec(**config).model_dump(mode="json"))
    var = tf.Variable(np.ones(3, np.float32))
    optimizer.build([var])
    optimizer.apply_gradients([(tf.constant([1.0, -1.0, 0.0]), var)])
    value = var.numpy()
    assert value[0] < 1.0 < value[1] and value[2] == pytest.approx(1.0)


def test_plain_sgd_is_exact():
    optimizer = build_optimizer(OptimizerSpec(name="sgd", learning_rate=0.5).model_dump(mode="json"))
    var = tf.Variable([2.0])
    optimizer.apply_gradients([(tf.constant([1.0]), var)])
    assert var.numpy()[0] == pytest.approx(1.5)


def test_exponential_decay_with_staircase_follows_applied_updates():
    spec = OptimizerSpec(
        name="sgd",
        learning_rate={
            "schedule": "exponential_decay",
            "initial_learning_rate": 1.0,
            "decay_steps": 2,
            "decay_rate": 0.5,
            "staircase": True,
        },
    )
    optimizer = build_optimizer(spec.model_dump(mode="json"))
    var = tf.Variable([0.0])
    moves = []
    for _ in range(4):
        before = float(var.numpy()[0])
        optimizer.apply_gradients([(tf.constant([-1.0]), var)])
        moves.append(round(float(var.numpy()[0]) - before, 6))
    assert moves == [1.0, 1.0, 0.5, 0.5]
