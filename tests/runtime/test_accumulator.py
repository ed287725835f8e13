import numpy as np
import tensorflow as tf

from towerflow.runtime.accumulator import GradientAccumulator


def _read_only(values):
    array = np.asarray(values, np.float32)
    array.setflags(write=False)  # as arrays come out of Ray's object store
    return array


def test_sums_gradients_as_they_come_and_starts_over_after_each_take():
    like = [tf.Variable(np.zeros(3, np.float32)), tf.Variable(np.zeros((2, 2), np.float32))]
    accumulator = GradientAccumulator(tf, like)
    for k in (1.0, 2.0, 4.0):
        accumulator.add([_read_only([k] * 3), _read_only([[k, -k], [0, 1]])])
    sums, count = accumulator.take()
    assert count == 3
    np.testing.assert_allclose(sums[0].numpy(), [7.0] * 3)
    np.testing.assert_allclose(sums[1].numpy(), [[7.0, -7.0], [0.0, 3.0]])

    accumulator.add([_read_only([5.0] * 3), _read_only([[1, 1], [1, 1]])])  # the next step replaces the sum
    sums, count = accumulator.take()
    assert count == 1
    np.testing.assert_allclose(sums[0].numpy(), [5.0] * 3)
    assert accumulator.count == 0
