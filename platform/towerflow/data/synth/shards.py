"""Write generated columns as named TFRecord or CSV shards, plus the manifest that describes them.

A generator yields chunks of columns (numpy arrays, first axis = examples); `SplitWriter` cuts
that stream into shards of planned sizes, so the examples do not depend on the shard count.
TFRecord rows become `tf.train.Example`s (bytes features from the raw array bytes, int64 and
float32 as lists); CSV rows are written by pyarrow's C++ writer, floats in shortest round-trip form.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.errors import SpecError

MANIFEST = "manifest.json"
FORMATS = ("tfrecord", "csv")
CSV_OPTIONS = {"header": True, "delimiter": ","}
_SHARD_NAME = re.compile(r"^(train|eval)-\d{5}-of-\d{5}(\.csv)?$")

Progress = Callable[[int], None]  # called with the number of examples just written


def shard_sizes(examples: int, shards: int) -> list[int]:
    """Split examples as evenly as possible: the first ``examples % shards`` shards get one more."""
    base, extra = divmod(examples, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def shard_names(split: str, shards: int, fmt: str = "tfrecord") -> list[str]:
    suffix = ".csv" if fmt == "csv" else ""
    return [f"{split}-{i:05d}-of-{shards:05d}{suffix}" for i in range(shards)]


def check_plan(fmt: str, plan: dict[str, tuple[int, int]]) -> None:
    """Reject a format or a split plan (examples, shards) that cannot be written, before writing anything."""
    if fmt not in FORMATS:
        raise SpecError(f"synthetic data: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    for split, (examples, shards) in plan.items():
        if shards < 1 or examples < shards:
            raise SpecError(
                f"synthetic {split} split: need at least one shard and one example per shard, "
                f"got {examples} examples for {shards} shards"
            )


def remove_stale(out: Path, keep: set[str]) -> None:
    """Drop the manifest and shards of an earlier run so ``train-*`` globs see only this one."""
    (out / MANIFEST).unlink(missing_ok=True)
    for path in out.iterdir():
        if _SHARD_NAME.match(path.name) and path.name not in keep:
            path.unlink()


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Atomic: a reader sees either no manifest or a complete one, never a half-written data set."""
    tmp = out / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)


class _TFRecordShard:
    """One TFRecord file; a single Example is reused per record (building fresh protos is the slow part)."""

    def __init__(self, path: Path, features: dict[str, dict[str, Any]]):
        from towerflow.tf_import import import_tensorflow

        # lazily: the CLI must not pay for TensorFlow before it is needed; writing builds no model
        tf = import_tensorflow(gpus=False, keras=False)

        self._writer = tf.io.TFRecordWriter(str(path))
        self._example = tf.train.Example()
        feature = self._example.features.feature
        kinds = {"bytes": "bytes_list", "int64": "int64_list", "float32": "float_list"}
        self._lists = {name: getattr(feature[name], kinds[f["dtype"]]).value for name, f in features.items()}
        self._bytes = {name for name, f in features.items() if f["dtype"] == "bytes"}

    def write(self, columns: dict[str, np.ndarray]) -> None:
        rows = len(next(iter(columns.values())))
        # Python lists once per chunk: indexing numpy scalars per record is several times slower.
        flat = {
            name: col if name in self._bytes else (col.reshape(rows, -1) if col.ndim > 1 else col).tolist()
            for name, col in columns.items()
        }
        for i in range(rows):
            for name, values in self._lists.items():
                del values[:]
                value = flat[name][i]
                if name in self._bytes:
                    values.append(value.tobytes())
                elif isinstance(value, list):
                    values.extend(value)
                else:
                    values.append(value)
            self._writer.write(self._example.SerializeToString())

    def close(self) -> None:
        self._writer.close()


class _CSVShard:
    """One CSV file with an unquoted header row; every column is a scalar per row."""

    def __init__(self, path: Path, features: dict[str, dict[str, Any]]):
        self._file = path.open("wb")
        self._names = list(features)
        self._file.write((",".join(self._names) + "\n").encode())

    def write(self, columns: dict[str, np.ndarray]) -> None:
        import pyarrow as pa
        import pyarrow.csv as pa_csv

        table = pa.table({name: columns[name] for name in self._names})
        pa_csv.write_csv(table, self._file, pa_csv.WriteOptions(include_header=False, quoting_style="needed"))

    def close(self) -> None:
        self._file.close()


class SplitWriter:
    """Write one split as planned shards, taking column chunks of any size in order.

    `features` is the manifest's feature spec for the format (for CSV: every column, in order);
    the chunks given to `write` must carry exactly those names.
    """

    def __init__(
        self,
        out: Path,
        split: str,
        per_file: list[int],
        fmt: str,
        features: dict[str, dict[str, Any]],
        progress: Progress | None = None,
    ):
        self.files = shard_names(split, len(per_file), fmt)
        self._paths = [out / name for name in self.files]
        self._per_file = per_file
        self._features = features
        self._shard_type = _CSVShard if fmt == "csv" else _TFRecordShard
        self._progress = progress
        self._index = -1
        self._room = 0
        self._shard: _TFRecordShard | _CSVShard | None = None

    def write(self, columns: dict[str, np.ndarray]) -> None:
        rows = len(next(iter(columns.values())))
        start = 0
        while start < rows:
            if self._room == 0:
                self._next_shard()
            stop = min(rows, start + self._room)
            self._shard.write({name: col[start:stop] for name, col in columns.items()})
            self._room -= stop - start
            start = stop
        if self._progress:
            self._progress(rows)

    def _next_shard(self) -> None:
        if self._shard is not None:
            self._shard.close()
        self._index += 1
        if self._index >= len(self._paths):
            raise RuntimeError("more examples than the split's shards were planned for")
        self._shard = self._shard_type(self._paths[self._index], self._features)
        self._room = self._per_file[self._index]

    def close(self, *, complete: bool = True) -> None:
        """Close the last shard; unless told the split was abandoned, every shard must be full."""
        if self._shard is not None:
            self._shard.close()
            self._shard = None
        if complete and self._index != len(self._paths) - 1 or self._room:
            raise RuntimeError("fewer examples than the split's shards were planned for")
