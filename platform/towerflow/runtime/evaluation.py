"""Evaluation: the loop over the evaluation files (`evaluate_model`) and its streaming metrics,
accumulated batch by batch and made anew at each evaluation.

Classification metrics come from one running confusion matrix (accuracy, macro precision and
recall); AUC from Keras's streaming AUC (one-vs-rest, macro, for more than two classes);
regression metrics from running sums; perplexity is exp of the mean per-token cross-entropy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from towerflow.runtime.worker_config import WorkerConfig

CLASSIFICATION = {"accuracy", "precision", "recall", "auc"}


class StreamingMetrics:
    def __init__(self, names: list[str], *, loss: str, from_logits: bool, num_outputs: int) -> None:
        self.names = list(names)
        self.loss_name = loss
        self.from_logits = from_logits
        self.num_outputs = num_outputs
        self._loss_sum = 0.0
        self._loss_count = 0
        self._examples = 0
        classes = 2 if num_outputs == 1 else num_outputs
        self._classes = classes
        self._confusion = np.zeros((classes, classes), np.int64)
        self._abs = self._sq = 0.0
        self._values = 0
        self._auc = None
        if "auc" in self.names:
            import keras
            import tensorflow as tf

            self._auc = (
                keras.metrics.AUC(num_thresholds=200)
                if classes == 2
                else keras.metrics.AUC(num_thresholds=200, multi_label=True, num_labels=classes)
            )
            # Traced once: called eagerly, the multi-label AUC re-traces its vectorized map on every
            # batch (TensorFlow warns of it), about 8x slower.
            self._auc_update = tf.function(self._auc.update_state, reduce_retracing=True)

    def update(self, labels: np.ndarray, outputs: np.ndarray, token_losses: np.ndarray) -> None:
        """`token_losses`: the per-example (or per-token) loss values of this batch."""
        self._loss_sum += float(np.sum(token_losses))
        self._loss_count += int(np.size(token_losses))
        self._examples += int(labels.shape[0])
        wanted = set(self.names)
        if wanted & CLASSIFICATION and self.loss_name not in ("mse", "mae"):
            probabilities = self._probabilities(outputs)
            predicted, truth = self._class_ids(probabilities), self._true_ids(labels)
            np.add.at(self._confusion, (truth.reshape(-1), predicted.reshape(-1)), 1)
            if self._auc is not None:
                if self._classes == 2:
                    positive = (
                        probabilities.reshape(-1)
                        if self.num_outputs == 1
                        else probabilities[..., 1].reshape(-1)
                    )
                    self._auc_update(truth.reshape(-1), positive)
                else:
                    flat = probabilities.reshape(-1, self._classes)
                    self._auc_update(np.eye(self._classes)[truth.reshape(-1)], flat)
        if wanted & {"mse", "mae", "rmse"}:
            error = outputs.reshape(labels.shape[0], -1) - labels.reshape(labels.shape[0], -1).astype(
                np.float32
            )
            self._abs += float(np.abs(error).sum())
            self._sq += float((error**2).sum())
            self._values += int(error.size)

    def result(self) -> dict[str, float]:
        out: dict[str, float] = {}
        mean_loss = self._loss_sum / max(1, self._loss_count)
        confusion = self._confusion
        for name in self.names:
            if name == "loss":
                out[name] = mean_loss
            elif name == "perplexity":
                out[name] = math.exp(min(mean_loss, 700.0))
            elif name == "accuracy":
                out[name] = float(np.trace(confusion) / max(1, confusion.sum()))
            elif name in ("precision", "recall"):
                axis = 0 if name == "precision" else 1
                totals = confusion.sum(axis=axis)
                hits = np.diag(confusion)
                if self._classes == 2:  # the positive class, as Keras's Precision/Recall report
                    out[name] = float(hits[1] / totals[1]) if totals[1] else 0.0
                else:  # macro average over the classes that occur
                    present = totals > 0
                    out[name] = float(np.mean(hits[present] / totals[present])) if present.any() else 0.0
            elif name == "auc":
                out[name] = float(self._auc.result())
            elif name == "mse":
                out[name] = self._sq / max(1, self._values)
            elif name == "mae":
                out[name] = self._abs / max(1, self._values)
            elif name == "rmse":
                out[name] = math.sqrt(self._sq / max(1, self._values))
        out["examples"] = float(self._examples)
        return out

    # -- helpers ---------------------------------------------------------------------------------
    def _probabilities(self, outputs: np.ndarray) -> np.ndarray:
        if not self.from_logits:
            return outputs
        if self.num_outputs == 1:
            return 1.0 / (1.0 + np.exp(-outputs))
        shifted = outputs - outputs.max(axis=-1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=-1, keepdims=True)

    def _class_ids(self, probabilities: np.ndarray) -> np.ndarray:
        if self.num_outputs == 1:
            return (probabilities.reshape(probabilities.shape[0], -1)[:, 0] > 0.5).astype(np.int64)
        return probabilities.argmax(axis=-1)

    def _true_ids(self, labels: np.ndarray) -> np.ndarray:
        if self.loss_name == "categorical_crossentropy":
            return labels.argmax(axis=-1)
        return labels.astype(np.int64).reshape(labels.shape[0], *labels.shape[1:])


def per_example_loss(loss_fn: Any, labels: Any, outputs: Any) -> np.ndarray:
    """The loss of every example (or token): Keras losses with reduction=None."""
    return np.asarray(loss_fn(labels, outputs))


def evaluate_model(
    model: Any,
    adapter: Any,
    source: Any,
    config: WorkerConfig,
    loss_config: dict[str, Any],
    metric_names: list[str],
    batch_size: int,
    max_batches: int | None = None,
) -> dict[str, float]:
    """`model`'s metrics, its variables as they are, over the evaluation files of `source` read in
    order (at most `max_batches` batches); `adapter` turns a batch into the model's inputs and labels."""
    import keras

    from towerflow.data.eval_reader import iter_eval_batches
    from towerflow.runtime.batches import TowerModel

    loss_fn = keras.losses.get({**loss_config, "config": {**loss_config["config"], "reduction": None}})
    outputs_shape = model.outputs[0].shape
    metrics = StreamingMetrics(
        metric_names,
        loss=config.loss,
        from_logits=config.from_logits,
        num_outputs=int(outputs_shape[-1]) if outputs_shape[-1] is not None else 1,
    )
    forward = TowerModel(model, source.tower_preprocess) if source.tower_preprocess else model
    for count, batch in enumerate(iter_eval_batches(source.files, source.reader, batch_size)):
        if max_batches is not None and count >= max_batches:
            break
        inputs, labels = adapter(batch)
        outputs = np.asarray(forward(inputs, training=False))
        metrics.update(labels, outputs, per_example_loss(loss_fn, labels, outputs))
    return metrics.result()
