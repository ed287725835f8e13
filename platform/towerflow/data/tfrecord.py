"""Parse TFRecord shards of tf.train.Example in TensorFlow's C++ parser, whole batches at a time.

Python never loops over records on the good path: a file is read as batches of serialized records
and each batch goes through one `tf.io.parse_example` call, then raw-byte features are decoded in
one op. Only when a batch fails does the reader look at its records one by one, to name the bad
record (on_bad_record: error) or drop it and go on (skip).
"""

from __future__ import annotations

import re
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from towerflow.data.bad_records import BadRecords
from towerflow.data.sources import local_copy, vanished
from towerflow.errors import DataError

READ_BATCH = 2048
_TF_DTYPES = {"int64": "int64", "float32": "float32", "bytes": "string"}


def feature_map(features: dict[str, dict[str, Any]]):
    """tf.io parsing specs: FixedLenFeature (with its default), or VarLenFeature."""
    import tensorflow as tf

    parsers = {}
    for name, f in features.items():
        dtype = getattr(tf, _TF_DTYPES[f["dtype"]])
        if f.get("varlen"):
            parsers[name] = tf.io.VarLenFeature(dtype)
            continue
        shape = list(f.get("shape") or [])
        default = f.get("default")
        if default is not None:
            np_dtype = object if f["dtype"] == "bytes" else f["dtype"]
            default = np.broadcast_to(np.asarray(_bytes(default), dtype=np_dtype), shape)
        parsers[name] = tf.io.FixedLenFeature(shape, dtype, default_value=default)
    return parsers


def _bytes(value: Any) -> Any:
    return value.encode() if isinstance(value, str) else value


def read_tfrecord_file(
    path: str, features: dict[str, dict[str, Any]], bad: BadRecords | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Yield parsed, decoded column batches of one file; errors name the file and the record."""
    tf = tensorflow_for_reading()
    bad = bad or BadRecords()
    with local_copy(path) as local:
        yield from _read_local(tf, path, local, 0, feature_map(features), features, bad, resynced=False)


def _read_local(tf, path, local, first, parsers, features, bad: BadRecords, *, resynced: bool):
    """Read `local` (all of `path`, or its tail after a skipped corrupt record, which was record `first` - 1)."""
    records = first  # records of the file handed on or judged so far
    batches = iter(tf.data.TFRecordDataset(local, buffer_size=1 << 20).batch(READ_BATCH))
    while True:
        try:
            serialized = next(batches)
        except StopIteration:
            return
        except tf.errors.DataLossError as exc:
            yield from _corrupt(tf, path, local, first, records, parsers, features, bad, exc, resynced)
            return
        except tf.errors.NotFoundError:
            raise vanished(path) from None
        except tf.errors.OpError as exc:
            raise DataError(f"{path}: cannot read after record {records} ({_parse_reason(exc)})") from None
        columns = _parse(tf, path, serialized, records, parsers, features, bad)
        records += int(serialized.shape[0])
        if columns is not None:
            yield columns


class _JudgeRecords(Exception):
    """A batch holds a bad record: look at its records one by one."""


def _parse(tf, path, serialized, first, parsers, features, bad: BadRecords) -> dict[str, np.ndarray] | None:
    """One batch in one parse_example call; on failure, judge its records one by one."""
    try:
        return _columns(tf, path, tf.io.parse_example(serialized, parsers), first, features)
    except (tf.errors.InvalidArgumentError, _JudgeRecords):
        pass
    keep = []
    for i in range(int(serialized.shape[0])):
        try:
            _columns(tf, path, tf.io.parse_example(serialized[i : i + 1], parsers), first + i, features)
            keep.append(i)
        except tf.errors.InvalidArgumentError as exc:
            bad.bad(path, f"record {first + i}", f"does not match the feature spec ({_parse_reason(exc)})")
        except _JudgeRecords as exc:
            bad.bad(path, f"record {first + i}", str(exc))
    if not keep:
        return None
    subset = tf.gather(serialized, keep)
    return _columns(tf, path, tf.io.parse_example(subset, parsers), first, features)


def _columns(tf, path, parsed, first, features) -> dict[str, np.ndarray]:
    """Parsed tensors to NumPy columns: decode raw bytes, densify or keep varlen features ragged."""
    out = {}
    for name, spec in features.items():
        column = parsed[name]
        if spec.get("varlen"):
            out[name] = _varlen(tf, column, spec)
        elif spec.get("decode"):
            out[name] = _decode(tf, path, name, column, spec, first)
        else:
            out[name] = column.numpy()
    return out


def _decode(tf, path, name, column, spec, first) -> np.ndarray:
    """decode_raw a batch of byte strings; a wrong-sized record sends the batch to the record path."""
    out_dtype = tf.uint8 if spec["decode"] == "uint8" else tf.float32
    shape = [int(d) for d in (spec.get("decoded_shape") or [-1])]
    if -1 not in shape:
        want = int(np.prod(shape)) * out_dtype.size
        lengths = tf.strings.length(column).numpy()
        wrong = np.flatnonzero(lengths != want)
        if len(wrong):
            raise _JudgeRecords(
                f"feature {name!r} has {lengths[wrong[0]]} bytes; decode {spec['decode']} to {shape} needs {want}"
            )
    try:
        decoded = tf.io.decode_raw(column, out_dtype)
        # The batch's size given, not -1: a decoded_shape left out, or with a -1 of its own, may
        # hold one -1 (its record's length decides it), and reshape takes one at most.
        return tf.reshape(decoded, [tf.shape(decoded)[0], *shape]).numpy()
    except tf.errors.InvalidArgumentError as exc:
        raise DataError(
            f"{path}: records {first}+: feature {name!r} does not decode as {spec['decode']} of shape "
            f"{shape} ({_first_line(exc)})"
        ) from None


def _varlen(tf, sparse, spec) -> np.ndarray:
    """A VarLenFeature batch: dense [n, pad_to] when pad_to is given, else one array per record."""
    default = spec.get("default")
    if default is None:
        default = b"" if spec["dtype"] == "bytes" else 0
    if spec.get("pad_to"):
        dense = tf.sparse.to_dense(sparse, default_value=_bytes(default)).numpy()
        width = int(spec["pad_to"])
        if dense.shape[1] >= width:
            return dense[:, :width]
        pad = np.full((dense.shape[0], width - dense.shape[1]), _bytes(default), dtype=dense.dtype)
        return np.concatenate([dense, pad], axis=1)
    ragged = tf.RaggedTensor.from_sparse(sparse)
    values, splits = ragged.values.numpy(), ragged.row_splits.numpy()
    return ragged_column(values, splits)


def ragged_column(values: np.ndarray, row_splits: np.ndarray) -> np.ndarray:
    """One 1-D array per record (Ray Data keeps them as a variable-shaped tensor column)."""
    parts = np.split(values, row_splits[1:-1])
    column = np.empty(len(parts), dtype=object)
    for i, part in enumerate(parts):
        column[i] = part
    return column


def _corrupt(tf, path, local, first, records, parsers, features, bad: BadRecords, exc, resynced):
    """A record could not be read (bad length or CRC): find which, hand on the good ones before it;
    in skip mode go on after it when its length field still frames the next record."""
    good, index = [], 0
    try:
        for record in tf.data.TFRecordDataset(local):
            if first + index >= records:
                good.append(record.numpy())
            index += 1
    except tf.errors.DataLossError as again:
        exc = again
    if good:
        columns = _parse(tf, path, tf.constant(good), records, parsers, features, bad)
        if columns is not None:
            yield columns
    where = f"record {first + index}"
    if resynced and index == 0:  # the skipped record's length did not frame a record: give up
        bad.bad(path, where, f"corrupt TFRecord, the rest of the file is unreadable ({_parse_reason(exc)})")
        return
    tail = _bytes_after(local, index)
    lost = "" if tail is not None else ", the rest of the file is unreadable"
    bad.bad(path, where, f"corrupt TFRecord{lost} ({_parse_reason(exc)})")
    if tail:
        with tempfile.NamedTemporaryFile(prefix="towerflow-tail-") as rest:
            rest.write(tail)
            rest.flush()
            yield from _read_local(
                tf, path, rest.name, first + index + 1, parsers, features, bad, resynced=True
            )


def _bytes_after(local: str, index: int) -> bytes | None:
    """The file's bytes after record `index`, framed by the length fields (error path only);
    None when the framing runs past the end (a bad length, or a truncated file)."""
    with open(local, "rb") as f:
        data = f.read()
    offset = 0
    for _ in range(index + 1):
        if offset + 8 > len(data):
            return None
        (length,) = struct.unpack_from("<Q", data, offset)
        offset += 16 + length
    return data[offset:] if offset <= len(data) else None


_configured = False


def tensorflow_for_reading():
    """Import TensorFlow once per Ray Data worker process, with one thread (tasks run side by side)."""
    global _configured
    from towerflow.tf_import import import_tensorflow

    tf = import_tensorflow(gpus=False, keras=False)  # a read task builds no model
    if not _configured:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            pass  # the context already exists in this process: keep its settings
        _configured = True
    return tf


def _parse_reason(exc: Exception) -> str:
    """TensorFlow's message without its op wrapper and the batch-relative index."""
    text = (getattr(exc, "message", None) or str(exc)).strip().splitlines()[0]
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:[^\]]*\].*$|Name: [^,]*, ", "", text)
    return re.sub(r",? Index: \d+\.?\s*", ": ", text).strip()[:300]


def _first_line(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return text.strip().splitlines()[0][:300]
