"""Shard optimizers: TensorFlow's fused training kernels, checked against Keras and the textbook rules."""

import numpy as np
import pytest
import tensorflow as tf

from towerflow.runtime.optimizers import build_optimizer
from towerflow.spec import OptimizerSpec

GRADIENTS = [np.array([0.5, -1.0, 0.0], np.float32), np.array([-0.25, 2.0, 0.1], np.float32)] * 2


def _run_shard_rule(
    config: dict, gradients=GRADIENTS, start=(1.0, 2.0, -1.0), *, eager: bool = False
) -> np.ndarray:
    """Apply `gradients` one update each: in a tf.function, or eagerly as a shard does (the
    update's scalars made once, numpy gradients as they arrive)."""
    optimizer = build_optimizer(OptimizerSpec(**config).model_dump(mode="json"))
    value = np.array(start, np.float32)
    var = tf.Variable(value)
    slots = {s: tf.Variable(optimizer.slot_initial_value(s, value)) for s in optimizer.slot_names}

    @tf.function
    def graph_step(gradient, lr, step):
        optimizer.apply(tf, var, slots, gradient, lr, step)

    def eager_step(gradient, lr, step):
        optimizer.apply_with(tf, var, slots, gradient.numpy(), optimizer.scalars(tf, lr, step))

    step = eager_step if eager else graph_step
    for version, gradient in enumerate(gradients):
        step(tf.constant(gradient), tf.constant(optimizer.learning_rate(version)), tf.constant(version + 1.0))
    return var.numpy()


def _run_keras(optimizer, gradients=GRADIENTS, start=(1.0, 2.0, -1.0)) -> np.ndarray:
    var = tf.Variable(np.array(start, np.float32))
    for gradient in gradients:
        optimizer.apply_gradients([(tf.constant(gradient), var)])
    return var.numpy()


@pytest.mark.parametrize(
    ("config", "keras_optimizer"),
    [
        ({"name": "sgd", "learning_rate": 0.1}, lambda k: k.optimizers.SGD(0.1)),
        (
            {"name": "momentum", "learning_rate": 0.1, "momentum": 0.5, "nesterov": True},
            lambda k: k.optimizers.SGD(0.1, momentum=0.5, nesterov=True),
        ),
        (
            {"name": "adam", "learning_rate": 0.01, "beta_1": 0.8},
            lambda k: k.optimizers.Adam(0.01, beta_1=0.8),
        ),
        (
            {"name": "rmsprop", "learning_rate": 0.01, "rho": 0.8, "momentum": 0.3},
            lambda k: k.optimizers.RMSprop(0.01, rho=0.8, momentum=0.3),
        ),
        (
            {"name": "rmsprop", "learning_rate": 0.01, "rho": 0.8, "centered": True},
            lambda k: k.optimizers.RMSprop(0.01, rho=0.8, centered=True),
        ),
    ],
)
@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
def test_fused_rules_match_keras(config, keras_optimizer, eager):
    import keras

    np.testing.assert_allclose(
        _run_shard_rule(config, eager=eager), _run_keras(keras_optimizer(keras)), rtol=1e-5, atol=1e-6
    )


def test_adagrad_follows_tensorflows_rule():
    got = _run_shard_rule({"name": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.2})
    var, accum = np.array([1.0, 2.0, -1.0]), np.full(3, 0.2)
    for gradient in GRADIENTS:
        accum += gradient.astype(np.float64) ** 2
        var -= 0.1 * gradient / (np.sqrt(accum) + 1e-7)
    np.testing.assert_allclose(got, var, rtol=1e-5)


def test_exponential_decay_with_staircase_follows_applied_updates():
    config = {
        "name": "sgd",
        "learning_rate": {
            "schedule": "exponential_decay",
            "initial_learning_rate": 1.0,
            "decay_steps": 2,
            "decay_rate": 0.5,
            "staircase": True,
        },
    }
    optimizer = build_optimizer(OptimizerSpec(**config).model_dump(mode="json"))
    assert [optimizer.learning_rate(step) for step in range(5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    moved = _run_shard_rule(config, gradients=[np.array([-1.0], np.float32)] * 4, start=(0.0,))
    assert moved[0] == pytest.approx(3.0)  # 1 + 1 + 0.5 + 0.5


def test_smooth_decay_matches_keras_schedule():
    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(0.3, 3, 0.7)
    optimizer = build_optimizer(
        OptimizerSpec(
            name="sgd",
            learning_rate={
                "schedule": "exponential_decay",
                "initial_learning_rate": 0.3,
                "decay_steps": 3,
                "decay_rate": 0.7,
            },
        ).model_dump(mode="json")
    )
    for step in range(7):
        assert optimizer.learning_rate(step) == pytest.approx(float(schedule(step)), rel=1e-6)
