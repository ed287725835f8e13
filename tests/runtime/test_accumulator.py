import numpy as np

from towerflow.runtime.accumulator import GradientAccumulator
from towerflow.runtime.shared_buffers import is_aligned


def _read_only(values):
    array = np.asarray(values, np.float32)
    array.setflags(write=False)  # as arrays come out of Ray's object store
    return array


def test_sums_gradients_as_they_come_and_starts_over_after_each_take():
    accumulator = GradientAccumulator()
    pushed = [[_read_only([k] * 3), _read_only([[k, -k], [0, 1]])] for k in (1.0, 2.0, 4.0)]
    for worker, gradients in zip((2, 0, 1), pushed):
        accumulator.add(gradients, worker)
    sums, workers = accumulator.take()
    assert workers == (0, 1, 2)  # in worker order, however the pushes raced
    np.testing.assert_allclose(sums[0], [7.0] * 3)
    np.testing.assert_allclose(sums[1], [[7.0, -7.0], [0.0, 3.0]])
    np.testing.assert_allclose(pushed[0][0], [1.0] * 3)  # the pushed arrays are never written

    # The next step replaces the sum.
    accumulator.add([_read_only([5.0] * 3), _read_only([[1, 1], [1, 1]])], 2)
    sums, workers = accumulator.take()
    assert workers == (2,)
    np.testing.assert_allclose(sums[0], [5.0] * 3)
    assert accumulator.count == 0


def test_later_steps_sum_into_the_same_buffers_from_zero():
    accumulator = GradientAccumulator()
    for step in range(3):
        accumulator.add([_read_only([1.0, 2.0])], 0)
        accumulator.add([_read_only([step, step])], 1)
        sums, workers = accumulator.take()
        assert workers == (0, 1)
        np.testing.assert_allclose(sums[0], [1.0 + step, 2.0 + step])  # nothing left from the step before


def test_the_sums_of_two_or_more_are_aligned_for_tensorflow_to_read_in_place():
    accumulator = GradientAccumulator()
    for worker, k in enumerate((1.0, 2.0)):
        accumulator.add([_read_only([k] * 1000), _read_only([k] * 3)], worker)
    sums, _ = accumulator.take()
    assert all(is_aligned(total) for total in sums)
