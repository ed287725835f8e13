"""Towers: one copy of the forward/backward pass per local device, gradients averaged per worker.

The worker's batch is split into one slice per tower; each tower computes the gradient of its own
slice's mean loss, and the worker averages them weighted by slice size, which equals the gradient
of the whole batch's mean loss. Model state (batch-norm moving statistics) moves once per step, by
the towers' updates averaged the same way, as MirroredStrategy's replicas' are (each tower updates
from the step's start): updated once per tower in turn, N towers would make its momentum m^N.

With push hooks, the graph also hands each bucket of averaged gradients to the worker the moment
backprop has produced it, while the backward pass of the layers below goes on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from towerflow.runtime.model_state import stateful_variables


def split_sizes(batch: int, towers: int) -> list[int]:
    """As even as possible: 10 over 3 towers is [4, 3, 3]. A tower may get 0 only if batch < towers."""
    base, extra = divmod(batch, towers)
    return [base + (1 if i < extra else 0) for i in range(towers)]


def signature_of(inputs: Any, labels: Any) -> tuple[Any, Any]:
    """The types and shapes of a worker batch (tf.TypeSpecs), which `TowerStep.trace` traces for."""
    import tensorflow as tf

    return tf.nest.map_structure(tf.type_spec_from_value, (inputs, labels))


class TowerStep:
    """Computes (loss, metrics, averaged gradients) for one worker batch across its towers."""

    def __init__(
        self,
        model: Any,
        loss_fn: Callable,
        devices: list[str],
        *,
        metrics: list[str] = (),
        clip_global_norm: float | None = None,
        from_logits: bool = False,
    ) -> None:
        import tensorflow as tf

        self._tf = tf
        self._model = model
        self.devices = list(devices)
        self._loss_fn = loss_fn
        self._metrics = list(metrics)
        self._clip = clip_global_norm
        self._from_logits = from_logits
        self._buckets: list[list[int]] = []
        self._on_bucket: Callable[..., Any] | None = None
        self.traces = 0  # how many times a step was traced (each costs seconds)
        self._step = self._new_step()

    def __call__(self, inputs: Any, labels: Any) -> tuple[Any, dict[str, Any], list[Any]]:
        return self._step(inputs, labels)

    def _new_step(self) -> Any:
        """The step as a new tf.function: traced again on its first call with what the graph reads
        (model, buckets, hook). One trace per batch size (the last batch of a run may be partial):
        the slice sizes are Python ints, which a relaxed (None) batch dimension would not give."""
        return self._tf.function(self._graph)

    @property
    def model(self) -> Any:
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model
        self._step = self._new_step()  # the traces call the model they were made with

    def push_in_buckets(self, buckets: list[list[int]], on_bucket: Callable[..., Any]) -> None:
        """Call `on_bucket(bucket, loss, *gradients)` from inside the graph for each bucket of
        variable indices, in order, as soon as the bucket's averaged gradients exist.

        The graph runs its stateful ops in program order, so the hooks fire in bucket order; with
        at least two inter-op threads a hook runs beside the rest of the backward pass.

        The same buckets and hook again (a worker's next run, after a resize or a rollback) keep the
        traced step: tracing it anew costs every worker seconds before its first step.
        """
        buckets = [list(b) for b in buckets]
        if buckets == self._buckets and on_bucket == self._on_bucket:
            return
        self._buckets = buckets
        self._on_bucket = on_bucket
        self._step = self._new_step()  # retrace with the hooks

    def trace(self, signature: tuple[Any, Any]) -> None:
        """Trace the step for batches of `signature` (`signature_of` a batch) without running it: a
        spare worker does so before it joins a run, so that its first step computes at once instead
        of holding every worker of a sync step while it traces (seconds)."""
        self._step.get_concrete_function(*signature)

    def _graph(self, inputs, labels):
        self.traces += 1  # Python runs only while tracing
        tf = self._tf
        batch = int(labels.shape[0])
        sizes = [s for s in split_sizes(batch, len(self.devices)) if s > 0]
        input_slices = _split_inputs(tf, inputs, sizes)
        label_slices = tf.split(labels, sizes)
        weights = [s / batch for s in sizes]
        variables = self.model.trainable_variables
        state = stateful_variables(self.model) if len(sizes) > 1 else []
        state_at_start = [tf.identity(v) for v in state]
        state_sums = [tf.zeros_like(v) for v in state_at_start]
        total_loss, total_grads, total_metrics = 0.0, None, {}
        for tower, (device, weight) in enumerate(zip(self.devices, weights)):
            x = (
                {k: parts[tower] for k, parts in input_slices.items()}
                if isinstance(inputs, dict)
                else input_slices[tower]
            )
            y = label_slices[tower]
            with tf.device(device), tf.GradientTape() as tape:
                outputs = self.model(x, training=True)
                loss = self._loss_fn(y, outputs)
                if self.model.losses:
                    loss = loss + tf.add_n(self.model.losses)  # regularizers, as model.fit would add
            grads = tape.gradient(loss, variables)
            grads = [
                tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)
            ]
            for i, var in enumerate(state):  # this tower's update, then back to the step's start
                state_sums[i] += weight * tf.convert_to_tensor(var)
                var.assign(state_at_start[i])
            total_loss += weight * loss
            total_grads = (
                [weight * g for g in grads]
                if total_grads is None
                else [acc + weight * g for acc, g in zip(total_grads, grads)]
            )
            for name, value in self._batch_metrics(y, outputs).items():
                total_metrics[name] = total_metrics.get(name, 0.0) + weight * value
        for var, value in zip(state, state_sums):
            var.assign(value)
        if self._clip is not None:
            total_grads, _ = tf.clip_by_global_norm(total_grads, self._clip)
        if self._on_bucket is not None:
            for bucket, indices in enumerate(self._buckets):
                tf.numpy_function(
                    functools.partial(self._on_bucket, bucket),
                    [total_loss, *(total_grads[i] for i in indices)],
                    tf.int64,
                    stateful=True,
                    name=f"push_bucket_{bucket}",
                )
        return total_loss, total_metrics, total_grads

    def _batch_metrics(self, labels, outputs) -> dict[str, Any]:
        tf = self._tf
        found = {}
        for name in self._metrics:
            if name == "accuracy":
                if outputs.shape[-1] == 1:  # binary: logits or probabilities in one column
                    threshold = 0.0 if self._from_logits else 0.5
                    predicted = tf.cast(tf.squeeze(outputs, -1) > threshold, labels.dtype)
                else:
                    predicted = tf.argmax(outputs, axis=-1, output_type=tf.int64)
                    one_hot = (
                        labels.shape.rank == outputs.shape.rank and labels.shape[-1] == outputs.shape[-1]
                    )
                    # one-hot labels (float32 ones among them); else class ids, shaped [batch] or [batch, 1]
                    labels = (
                        tf.argmax(labels, axis=-1, output_type=tf.int64)
                        if one_hot
                        else tf.cast(labels, tf.int64)
                    )
                found[name] = tf.reduce_mean(
                    tf.cast(tf.equal(predicted, tf.reshape(labels, tf.shape(predicted))), tf.float32)
                )
            elif name in ("mse", "mae"):
                diff = tf.cast(outputs, tf.float32) - tf.cast(
                    tf.reshape(labels, tf.shape(outputs)), tf.float32
                )
                found[name] = tf.reduce_mean(tf.square(diff) if name == "mse" else tf.abs(diff))
        return found


def _split_inputs(tf: Any, inputs: Any, sizes: list[int]) -> Any:
    if isinstance(inputs, dict):
        return {name: tf.split(value, sizes) for name, value in inputs.items()}
    return tf.split(inputs, sizes)
