"""Numpy buffers that TensorFlow uses in place instead of copying them.

A raw TensorFlow op takes a numpy array that starts on a 64-byte boundary (its allocator's
alignment) as a tensor without copying it, and `AssignVariableOp` makes that tensor's buffer the
variable's own. Ray places every array of 2 KiB and more on a 64-byte boundary in its object store,
so a parameter a worker reads from a shard's published version becomes its variable's value with no
copy; `Variable.assign` converts first and copies (13 MB: about 0.1 against 1.8 ms here, on the
path every sync step waits on). A shard's gradient sums kept in aligned buffers reach its fused
update kernel the same way, and the row slices of a variable cut across shards are joined by
TensorFlow straight into the tensor the variable then holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ALIGNMENT = 64  # bytes: TensorFlow's EIGEN_MAX_ALIGN_BYTES on x86-64 and aarch64


def aligned_empty_like(array: np.ndarray) -> np.ndarray:
    """An uninitialised array of `array`'s shape and dtype whose data starts on a 64-byte boundary."""
    raw = np.empty(array.nbytes + ALIGNMENT, dtype=np.uint8)
    offset = -raw.ctypes.data % ALIGNMENT
    return raw[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)


def is_aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % ALIGNMENT == 0


def assign_immutable(variable: Any, value: np.ndarray) -> None:
    """Make `value` the variable's value, sharing its buffer where TensorFlow can.

    `value` must never change afterwards (an array read from Ray's object store never does), and
    nothing may update the variable in place while it holds it: the variable's next value comes by
    assignment again. Anything that TensorFlow cannot share (another dtype or shape, not contiguous,
    not aligned) is copied by `Variable.assign`, which also raises its usual errors.
    """
    import tensorflow as tf

    if (
        isinstance(value, np.ndarray)
        and value.dtype == np.dtype(variable.dtype)
        and value.shape == tuple(variable.shape)
        and value.flags.c_contiguous
        and is_aligned(value)
    ):
        tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value)
    else:
        variable.assign(value)


def assign_rows(variable: Any, rows: list[np.ndarray]) -> None:
    """Make `rows` (consecutive row slices, in order) the variable's value: they are joined in one
    copy, which the variable then holds as its own (a staging buffer and `Variable.assign` cost two
    copies more; 13 MB in two halves: 0.8 against 2.1 ms here)."""
    import tensorflow as tf

    shape = (sum(len(part) for part in rows), *rows[0].shape[1:])
    if shape != tuple(variable.shape):
        raise ValueError(
            f"{variable.path}: rows of shape {shape} for a variable of shape {tuple(variable.shape)}"
        )
    joined = tf.raw_ops.ConcatV2(values=rows, axis=0)
    tf.raw_ops.AssignVariableOp(resource=variable.handle, value=joined)


def assign_pulled(
    variables: list[Any],
    per_shard: list[list[np.ndarray]],
    placement: list[list[tuple[int, int, int, bool]]],
) -> None:
    """Load parameters pulled from the shards into the model's variables: a whole variable takes
    its (immutable) array's buffer without a copy, a variable cut across shards its rows joined in
    one copy. `placement[s]` lists shard s's pieces as (variable index, start, stop, whole?)."""
    cut: dict[int, list[tuple[int, np.ndarray]]] = {}
    for shard_values, pieces in zip(per_shard, placement):
        for value, (index, start, _stop, whole) in zip(shard_values, pieces):
            if whole:
                assign_immutable(variables[index], value)
            else:
                cut.setdefault(index, []).append((start, value))
    for index, rows in cut.items():
        assign_rows(variables[index], [value for _, value in sorted(rows, key=lambda row: row[0])])
