"""Shard optimizers: TensorFlow's fused training ops over a shard's own variables and slots.

Each shard owns one optimizer over its own pieces, so slots live beside their variables and the
learning-rate schedule's step is the shard's version (the global step). The update rules are
TensorFlow's training kernels (`ResourceApplyAdam`, ...), the ones `tf.compat.v1.train` optimizers
ran on parameter servers: one fused, multi-threaded kernel per variable instead of a graph of
element-wise ops, and slots as plain variables that a checkpoint names and a re-shard slices.
"""

from __future__ import annotations

import math
from typing import Any


class ShardOptimizer:
    """One update rule: which slots a variable needs and how a gradient moves it."""

    slot_names: tuple[str, ...] = ()

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._schedule = config["learning_rate"]

    def learning_rate(self, step: int) -> float:
        """The rate for the update that turns version `step` into `step + 1`."""
        lr = self._schedule
        if not isinstance(lr, dict):
            return float(lr)
        if lr["schedule"] == "constant":
            return float(lr["initial_learning_rate"])
        exponent = step / lr["decay_steps"]
        if lr["staircase"]:
            exponent = math.floor(exponent)
        return float(lr["initial_learning_rate"] * lr["decay_rate"] ** exponent)

    def slot_initial_value(self, slot: str, value):
        """A slot's starting value for a variable holding `value` (numpy)."""
        import numpy as np

        return np.zeros_like(value)

    def scalars(self, tf, lr, step) -> dict[str, Any]:
        """The scalar tensors of one update, made once and shared by every variable it moves:
        a shard updates eagerly, where each small op costs a dispatch. `lr` and `step` (1-based)
        are float32 scalars."""
        return {"lr": lr}

    def apply_with(self, tf, variable, slots: dict[str, Any], gradient, scalars: dict[str, Any]) -> None:
        """One fused update of `variable`, with `scalars` from `scalars()`."""
        raise NotImplementedError

    def apply(self, tf, variable, slots: dict[str, Any], gradient, lr, step) -> None:
        """One fused update, eagerly or inside a tf.function."""
        self.apply_with(tf, variable, slots, gradient, self.scalars(tf, lr, step))

    def apply_all(self, tf, variables: list[Any], slots: list[dict[str, Any]], gradients, lr, step) -> None:
        """One update of several pieces, eagerly as a shard runs it: the scalars made once, then one
        fused kernel per piece (a tf.function's dispatch costs more than a small update)."""
        scalars = self.scalars(tf, lr, step)
        for variable, variable_slots, gradient in zip(variables, slots, gradients, strict=True):
            self.apply_with(tf, variable, variable_slots, gradient, scalars)

    def _option(self, name: str, default: Any) -> Any:
        value = self.config.get(name)
        return default if value is None else value


class GradientDescent(ShardOptimizer):
    def apply_with(self, tf, variable, slots, gradient, scalars) -> None:
        tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=scalars["lr"], delta=gradient)


class Momentum(ShardOptimizer):
    """Keras's momentum rule: m = momentum * m - lr * g; var += m (Nesterov optional)."""

    slot_names = ("momentum",)

    def scalars(self, tf, lr, step) -> dict[str, Any]:
        return {"lr": lr, "momentum": tf.constant(self._option("momentum", 0.0), tf.float32)}

    def apply_with(self, tf, variable, slots, gradient, scalars) -> None:
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle,
            accum=slots["momentum"].handle,
            lr=scalars["lr"],
            grad=gradient,
            momentum=scalars["momentum"],
            use_nesterov=bool(self._option("nesterov", False)),
        )


class Adam(ShardOptimizer):
    slot_names = ("m", "v")

    def scalars(self, tf, lr, step) -> dict[str, Any]:
        beta_1 = tf.constant(self._option("beta_1", 0.9), tf.float32)
        beta_2 = tf.constant(self._option("beta_2", 0.999), tf.float32)
        return {
            "lr": lr,
            "beta1": beta_1,
            "beta2": beta_2,
            "beta1_power": tf.pow(beta_1, step),
            "beta2_power": tf.pow(beta_2, step),
            "epsilon": tf.constant(self._option("epsilon", 1e-7), tf.float32),
        }

    def apply_with(self, tf, variable, slots, gradient, scalars) -> None:
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=slots["m"].handle, v=slots["v"].handle, grad=gradient, **scalars
        )


class Adagrad(ShardOptimizer):
    """accum += g^2; var -= lr * g / (sqrt(accum) + epsilon)."""

    slot_names = ("accumulator",)

    def slot_initial_value(self, slot: str, value):
        import numpy as np

        return np.full_like(value, self._option("initial_accumulator_value", 0.1))

    def scalars(self, tf, lr, step) -> dict[str, Any]:
        return {"lr": lr, "epsilon": tf.constant(self._option("epsilon", 1e-7), tf.float32)}

    def apply_with(self, tf, variable, slots, gradient, scalars) -> None:
        tf.raw_ops.ResourceApplyAdagradV2(
            var=variable.handle, accum=slots["accumulator"].handle, grad=gradient, **scalars
        )


class RMSProp(ShardOptimizer):
    """ms = rho * ms + (1 - rho) g^2; mom = momentum * mom + lr g / sqrt(ms [- mg^2] + eps); var -= mom."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.centered = bool(self._option("centered", False))
        self.slot_names = ("ms", "mom", "mg") if self.centered else ("ms", "mom")

    def scalars(self, tf, lr, step) -> dict[str, Any]:
        return {
            "lr": lr,
            "rho": tf.constant(self._option("rho", 0.9), tf.float32),
            "momentum": tf.constant(self._option("momentum", 0.0), tf.float32),
            "epsilon": tf.constant(self._option("epsilon", 1e-7), tf.float32),
        }

    def apply_with(self, tf, variable, slots, gradient, scalars) -> None:
        handles = {"var": variable.handle, "ms": slots["ms"].handle, "mom": slots["mom"].handle}
        if self.centered:
            tf.raw_ops.ResourceApplyCenteredRMSProp(
                mg=slots["mg"].handle, grad=gradient, **handles, **scalars
            )
        else:
            tf.raw_ops.ResourceApplyRMSProp(grad=gradient, **handles, **scalars)


_RULES: dict[str, type[ShardOptimizer]] = {
    "sgd": GradientDescent,
    "momentum": Momentum,
    "adam": Adam,
    "adagrad": Adagrad,
    "rmsprop": RMSProp,
}


def build_optimizer(optimizer: dict[str, Any]) -> ShardOptimizer:
    """`optimizer` is `OptimizerSpec.model_dump(mode="json")`."""
    return _RULES[optimizer["name"]](optimizer)
