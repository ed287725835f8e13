"""Numpy buffers that TensorFlow takes in place: a pulled parameter becomes its variable's value."""

import gc
import time

import keras
import numpy as np
import pytest
import ray

from towerflow.runtime.shared_buffers import (
    aligned_empty_like,
    assign_immutable,
    assign_pulled,
    assign_rows,
    is_aligned,
)


def _misaligned(shape, dtype=np.float32) -> np.ndarray:
    """An array whose data starts 16 bytes past a 64-byte boundary (numpy's own alignment)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(size + 128, np.uint8)
    offset = -raw.ctypes.data % 64 + 16
    return raw[offset : offset + size].view(dtype).reshape(shape)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((3136, 1024), np.float32), ((7,), np.float64), ((0,), np.int32)]
)
def test_aligned_buffers_start_on_a_64_byte_boundary(shape, dtype):
    for _ in range(5):  # numpy's allocations land on several boundaries
        buffer = aligned_empty_like(np.zeros(shape, dtype))
        assert buffer.shape == shape and buffer.dtype == dtype and buffer.flags.c_contiguous
        assert is_aligned(buffer) or buffer.size == 0


def test_an_aligned_array_becomes_the_variables_value_without_a_copy():
    variable = keras.Variable(np.zeros((64, 32), np.float32))
    value = aligned_empty_like(np.zeros((64, 32), np.float32))
    value[:] = 1.0
    assign_immutable(variable, value)
    value[0, 0] = 5.0  # breaks the contract on purpose: the variable shows it, so no copy was made
    assert variable.numpy()[0, 0] == 5.0
    np.testing.assert_array_equal(variable.numpy()[1:], 1.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _misaligned((64, 32)),
        lambda: np.zeros((64, 32), np.float64),  # another dtype
        lambda: np.zeros((32, 64), np.float32).T,  # not contiguous
    ],
    ids=["misaligned", "float64", "transposed"],
)
def test_what_tensorflow_cannot_share_is_copied(make):
    variable = keras.Variable(np.zeros((64, 32), np.float32))
    value = make()
    value[...] = 2.0
    assign_immutable(variable, value)
    value[...] = 3.0
    np.testing.assert_array_equal(variable.numpy(), 2.0)


def test_a_value_of_another_shape_is_refused_as_assign_refuses_it():
    variable = keras.Variable(np.zeros((64, 32), np.float32))
    with pytest.raises(ValueError, match="shape"):
        assign_immutable(variable, aligned_empty_like(np.zeros((32, 64), np.float32)))


def test_a_value_read_from_the_object_store_is_shared_and_outlives_its_reference(ray_cluster):
    shape = (512, 1024)  # 2 MiB, as a large layer's kernel arrives from a shard
    variable = keras.Variable(np.zeros(shape, np.float32))
    pulled = ray.get(ray.put(np.full(shape, 7.0, np.float32)))
    assert is_aligned(pulled) and not pulled.flags.writeable  # what makes the pull copy-free
    assign_immutable(variable, pulled)
    del pulled
    gc.collect()
    time.sleep(1.5)  # past Ray's batching of frees: an unpinned buffer would be reused below
    for k in range(4):
        ray.get(ray.put(np.full(shape, float(k), np.float32)))
    np.testing.assert_array_equal(variable.numpy(), 7.0)


def test_row_slices_become_the_variables_value_in_order():
    variable = keras.Variable(np.zeros((5, 3), np.float32))
    full = np.arange(15, dtype=np.float32).reshape(5, 3)
    rows = [full[:2].copy(), _misaligned((3, 3))]
    rows[1][...] = full[2:]
    assign_rows(variable, rows)
    rows[0][...] = -1.0  # the variable holds a copy: the slices may change afterwards
    np.testing.assert_array_equal(variable.numpy(), full)


def test_rows_that_do_not_make_up_the_variable_are_refused_with_its_name():
    variable = keras.Variable(np.zeros((5, 3), np.float32), name="kernel")
    with pytest.raises(ValueError, match=r"kernel: rows of shape \(4, 3\) for a variable of shape \(5, 3\)"):
        assign_rows(variable, [np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)])


def test_pulled_pieces_load_whole_variables_and_join_cut_ones_across_shards():
    # variable 0 cut across both shards (shard 1 holds its first rows), variable 1 whole on shard 0
    kernel, bias = keras.Variable(np.zeros((5, 3), np.float32)), keras.Variable(np.zeros(3, np.float32))
    full = np.arange(15, dtype=np.float32).reshape(5, 3)
    placement = [[(0, 2, 5, False), (1, 0, 3, True)], [(0, 0, 2, False)]]
    per_shard = [[full[2:].copy(), np.full(3, 9.0, np.float32)], [full[:2].copy()]]
    assign_pulled([kernel, bias], per_shard, placement)
    np.testing.assert_array_equal(kernel.numpy(), full)
    np.testing.assert_array_equal(bias.numpy(), 9.0)
