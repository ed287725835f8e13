"""The averaged tower gradient equals the whole-batch gradient (towers on two logical CPUs)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import mlp
from towerflow.runtime.towers import TowerStep, signature_of, split_sizes


def test_split_sizes():
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(8, 2) == [4, 4]
    assert sum(split_sizes(131, 4)) == 131


@pytest.mark.parametrize("batch", [16, 9])
def test_tower_average_equals_whole_batch_gradient(batch):
    model = mlp.build(input_dim=6, num_classes=3, hidden=[8], l2=0.01, seed=3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=batch).astype(np.int64)

    towers = TowerStep(model, loss_fn, ["/CPU:0", "/CPU:1"], metrics=["accuracy"])
    loss, metrics, grads = towers(x, y)

    with tf.GradientTape() as tape:
        whole = loss_fn(y, model(x, training=True)) + tf.add_n(model.losses)
    expected = tape.gradient(whole, model.trainable_variables)
    assert towers.devices == ["/CPU:0", "/CPU:1"]
    np.testing.assert_allclose(float(loss), float(whole), rtol=1e-5)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0


def test_accuracy_reads_class_ids_of_any_shape_and_one_hot_labels_of_any_dtype():
    """Labels as features give them: int64 ids shaped [batch] or [batch, 1], or float32 one-hot
    rows (categorical_crossentropy). The same predictions score the same in each."""
    model = mlp.build(input_dim=6, num_classes=3, hidden=[8], seed=3)
    x = np.random.default_rng(1).normal(size=(12, 6)).astype(np.float32)
    ids = np.argmax(model(x).numpy(), axis=-1)
    ids[:3] = (ids[:3] + 1) % 3  # 9 of 12 right
    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dense = keras.losses.CategoricalCrossentropy(from_logits=True)
    for labels, loss_fn in (
        (ids.astype(np.int64), sparse),
        (ids.astype(np.int64).reshape(-1, 1), sparse),
        (np.eye(3, dtype=np.float32)[ids], dense),
    ):
        _, metrics, _ = TowerStep(model, loss_fn, ["/CPU:0"], metrics=["accuracy"])(x, labels)
        assert float(metrics["accuracy"]) == pytest.approx(0.75), labels.shape


def test_batch_norm_statistics_move_once_per_step_by_the_towers_mean():
    """Two towers on slices of 8 and 7 rows: the moving mean moves once, by the whole batch's
    mean (the slices' means weighted by their sizes), as one tower over the whole batch moves it;
    before, each tower moved it in turn (momentum m^2, the last slice weighing most)."""

    def model() -> keras.Model:
        inputs = keras.Input((3,))
        hidden = keras.layers.BatchNormalization(momentum=0.9)(inputs)
        return keras.Model(inputs, keras.layers.Dense(2)(hidden))

    rng = np.random.default_rng(2)
    x = (rng.normal(size=(16, 3)) + np.arange(16)[:, None]).astype(np.float32)  # slices' means differ
    y = rng.integers(0, 2, size=16).astype(np.int64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    moved = {}
    for devices in (["/CPU:0"], ["/CPU:0", "/CPU:1"]):
        keras.utils.set_random_seed(0)
        built = model()
        TowerStep(built, loss_fn, devices)(x[:15], y[:15])  # 15 rows: slices of 8 and 7
        moved[len(devices)] = built.layers[1].moving_mean.numpy()
    np.testing.assert_allclose(moved[2], 0.1 * x[:15].mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(moved[2], moved[1], rtol=1e-5)


def test_gradient_clipping_by_global_norm():
    model = mlp.build(input_dim=4, hidden=[4], seed=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = np.ones((4, 4), np.float32) * 50
    y = np.array([0, 1, 0, 1])
    _, _, grads = TowerStep(model, loss_fn, ["/CPU:0"], clip_global_norm=0.5)(x, y)
    assert float(tf.linalg.global_norm(grads)) == pytest.approx(0.5, rel=1e-4)


def test_push_hooks_hand_over_each_bucket_in_order_from_inside_the_graph():
    model = mlp.build(input_dim=6, num_classes=3, hidden=[8, 8], seed=1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=12).astype(np.int64)
    buckets = [[5, 4], [3, 2], [1, 0]]  # the last layer's variables first, as backprop makes them
    seen = []

    def hook(bucket, loss, *gradients):
        seen.append((bucket, float(loss), [np.array(g) for g in gradients]))
        return np.int64(0)

    towers = TowerStep(model, loss_fn, ["/CPU:0", "/CPU:1"])
    towers.push_in_buckets(buckets, hook)
    loss, _, grads = towers(x, y)
    assert [bucket for bucket, _, _ in seen] == [0, 1, 2]
    for bucket, hooked_loss, gradients in seen:
        assert hooked_loss == pytest.approx(float(loss))
        for index, gradient in zip(buckets[bucket], gradients, strict=True):
            np.testing.assert_allclose(gradient, grads[index].numpy(), atol=1e-7)


class _BucketCalls(list):
    """A push hook that notes the bucket of each call."""

    def __call__(self, bucket, loss, *gradients):
        self.append(bucket)
        return np.int64(0)


def _small_step(devices: list[str]):
    """A 2-layer MLP's TowerStep, a batch of 4, and a hook noting the buckets pushed."""
    model = mlp.build(input_dim=6, num_classes=3, hidden=[8], seed=2)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = np.ones((4, 6), np.float32), np.array([0, 1, 2, 0])
    return TowerStep(model, loss_fn, devices), x, y, _BucketCalls()


def test_a_next_run_with_the_same_buckets_keeps_the_traced_step():
    """A worker's run after a resize or a rollback sets the same hooks again: no new trace."""
    towers, x, y, calls = _small_step(["/CPU:0"])
    towers.push_in_buckets([[3, 2], [1, 0]], calls)
    towers(x, y)
    towers.push_in_buckets([[3, 2], [1, 0]], calls)
    towers(x, y)
    assert towers.traces == 1 and calls == [0, 1, 0, 1]
    towers.push_in_buckets([[3, 2, 1, 0]], calls)  # new buckets (new shards): traced anew
    towers(x, y)
    assert towers.traces == 2 and calls[4:] == [0]
    towers.model = towers.model  # a new model (a tower's preprocessing in front): traced anew
    towers(x, y)
    assert towers.traces == 3 and calls[5:] == [0]


def test_a_step_traced_ahead_for_a_batchs_signature_runs_that_batch_without_tracing_again():
    """A spare worker traces its step before it joins (runtime/worker.py `warm_up`)."""
    towers, x, y, calls = _small_step(["/CPU:0", "/CPU:1"])
    towers.push_in_buckets([[3, 2], [1, 0]], calls)
    towers.trace(signature_of(x, y))
    assert towers.traces == 1 and calls == []  # traced, not run
    towers(x, y)
    towers(x + 1, y)
    assert towers.traces == 1 and calls == [0, 1, 0, 1]
    towers(x[:3], y[:3])  # another batch size (a partial last batch): its own trace
    assert towers.traces == 2
