"""Parse TFRecord shards of tf.train.Example in TensorFlow's C++ parser, whole batches at a time.

Python never loops over records: a file is read as batches of serialized records and each batch
goes through one `tf.io.parse_example` call, then raw-byte features are decoded in one op.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from towerflow.errors import DataError

READ_BATCH = 2048
_DTYPES = {"int64": "int64", "float32": "float32", "bytes": "string"}


def feature_map(features: dict[str, dict[str, Any]]):
    import tensorflow as tf

    parsers = {}
    for name, f in features.items():
        dtype = getattr(tf, _DTYPES[f["dtype"]])
        default = f.get("default")
        parsers[name] = tf.io.FixedLenFeature(f.get("shape") or [], dtype, default_value=default)
    return parsers


def read_tfrecord_file(path: str, features: dict[str, dict[str, Any]]) -> Iterator[dict[str, np.ndarray]]:
    """Yield parsed, decoded column batches of one file; errors name the file and the record."""
    tf = _tensorflow()
    parsers = feature_map(features)
    records = 0
    try:
        for serialized in tf.data.TFRecordDataset(path, buffer_size=1 << 20).batch(READ_BATCH):
            try:
                parsed = tf.io.parse_example(serialized, parsers)
            except tf.errors.InvalidArgumentError as exc:
                raise DataError(
                    f"{path}: records {records}-{records + int(serialized.shape[0]) - 1} do not match the "
                    f"feature spec ({_first_line(exc)})"
                ) from None
            yield {name: _decode(tf, path, name, parsed[name], features[name]) for name in features}
            records += int(serialized.shape[0])
    except tf.errors.DataLossError as exc:
        raise DataError(f"{path}: corrupt TFRecord after record {records} ({_first_line(exc)})") from None
    except tf.errors.NotFoundError:
        raise DataError(f"{path}: file not found") from None


def _decode(tf, path: str, name: str, column, spec: dict[str, Any]) -> np.ndarray:
    if spec.get("decode") is None:
        return column.numpy()
    out_dtype = tf.uint8 if spec["decode"] == "uint8" else tf.float32
    shape = list(spec.get("decoded_shape") or [-1])
    try:
        decoded = tf.io.decode_raw(column, out_dtype)
        return tf.reshape(decoded, [-1, *shape]).numpy()
    except tf.errors.InvalidArgumentError as exc:
        raise DataError(
            f"{path}: feature {name!r} does not decode as {spec['decode']} of shape {shape} ({_first_line(exc)})"
        ) from None


_configured = False


def _tensorflow():
    """Import TensorFlow once per Ray Data worker process, with one thread (tasks run side by side)."""
    global _configured
    import tensorflow as tf

    if not _configured:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            pass  # the context already exists in this process: keep its settings
        _configured = True
    return tf


def _first_line(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return text.strip().splitlines()[0][:300]
