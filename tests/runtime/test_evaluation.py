"""Streaming evaluation metrics against direct computation over the whole set."""

import math

import keras
import numpy as np
import pytest

from towerflow.runtime.evaluation import StreamingMetrics


def _stream(metrics: StreamingMetrics, labels, outputs, losses, batch: int = 7) -> dict:
    for start in range(0, len(labels), batch):
        end = start + batch
        metrics.update(labels[start:end], outputs[start:end], losses[start:end])
    return metrics.result()


def test_multiclass_accuracy_and_macro_precision_recall():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=50)
    logits = rng.normal(size=(50, 3)) + np.eye(3)[labels] * 1.5
    names = ["loss", "accuracy", "precision", "recall", "auc"]
    result = _stream(
        StreamingMetrics(names, loss="sparse_categorical_crossentropy", from_logits=True, num_outputs=3),
        labels,
        logits,
        np.full(50, 0.5),
    )
    predicted = logits.argmax(axis=1)
    assert result["accuracy"] == pytest.approx(np.mean(predicted == labels))
    precision = np.mean([np.mean(labels[predicted == c] == c) for c in range(3)])
    recall = np.mean([np.mean(predicted[labels == c] == c) for c in range(3)])
    assert result["precision"] == pytest.approx(precision)
    assert result["recall"] == pytest.approx(recall)
    assert result["loss"] == pytest.approx(0.5) and 0.5 < result["auc"] <= 1.0
    assert result["examples"] == 50
    # Batches of 7 (the last of 1) give the AUC of the whole set at once, as Keras computes it.
    whole = keras.metrics.AUC(num_thresholds=200, multi_label=True, num_labels=3)
    whole.update_state(np.eye(3)[labels], keras.ops.softmax(logits))
    assert result["auc"] == pytest.approx(float(whole.result()), abs=1e-6)


def test_regression_errors_and_perplexity():
    rng = np.random.default_rng(1)
    labels = rng.normal(size=(40, 2)).astype(np.float32)
    outputs = labels + rng.normal(scale=0.3, size=(40, 2)).astype(np.float32)
    result = _stream(
        StreamingMetrics(["mse", "mae", "rmse"], loss="mse", from_logits=False, num_outputs=2),
        labels,
        outputs,
        np.zeros(40),
    )
    error = outputs - labels
    assert result["mse"] == pytest.approx(float(np.mean(error**2)), rel=1e-5)
    assert result["mae"] == pytest.approx(float(np.mean(np.abs(error))), rel=1e-5)
    assert result["rmse"] == pytest.approx(math.sqrt(float(np.mean(error**2))), rel=1e-5)

    token_losses = rng.uniform(1.0, 3.0, size=(40, 35))  # per-token cross-entropy of a language model
    perplexity = _stream(
        StreamingMetrics(
            ["perplexity"], loss="sparse_categorical_crossentropy", from_logits=True, num_outputs=50
        ),
        np.zeros((40, 35), np.int64),
        np.zeros((40, 35, 50), np.float32),
        token_losses,
    )["perplexity"]
    assert perplexity == pytest.approx(math.exp(token_losses.mean()))
