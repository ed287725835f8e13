"""Infer a feature spec from the first records when neither the job spec nor a manifest gives one.

TFRecord: a few Examples of the first file, read with the protobuf parser (a one-off, not the hot
path): a feature's list kind gives its dtype; the same length everywhere gives its shape (a length
of 1 is a scalar), differing lengths make it varlen. CSV: pyarrow's type inference on the first
block of the first file; integers become int64, other numbers float32, anything else bytes.
"""

from __future__ import annotations

import logging
from typing import Any

from towerflow.data.csv import CsvLayout
from towerflow.data.sources import local_copy, open_binary
from towerflow.errors import DataError

log = logging.getLogger(__name__)

SAMPLE_RECORDS = 64
_KINDS = {"int64_list": "int64", "float_list": "float32", "bytes_list": "bytes"}


def infer_tfrecord(path: str, sample: int = SAMPLE_RECORDS) -> dict[str, dict[str, Any]]:
    from towerflow.tf_import import import_tensorflow

    tf = import_tensorflow(gpus=False, keras=False)  # the driver's, where it has none yet

    lengths: dict[str, set[int]] = {}
    dtypes: dict[str, str] = {}
    seen = 0
    with local_copy(path) as local:
        try:
            for record in tf.data.TFRecordDataset(local).take(sample):
                example = tf.train.Example.FromString(record.numpy())
                for name, feature in example.features.feature.items():
                    kind = feature.WhichOneof("kind")
                    if kind is None:
                        continue
                    dtype = _KINDS[kind]
                    if dtypes.setdefault(name, dtype) != dtype:
                        raise DataError(
                            f"{path}: feature {name!r} is {dtypes[name]} in one record, {dtype} in another"
                        )
                    lengths.setdefault(name, set()).add(len(getattr(feature, kind).value))
                seen += 1
        except tf.errors.DataLossError as exc:
            if not seen:  # nothing to infer from
                raise DataError(
                    f"{path}: record {seen}: corrupt TFRecord ({str(exc).splitlines()[0]})"
                ) from None
            # The records before it tell the features; the reads judge this one as data.on_bad_record says.
        except Exception as exc:
            if isinstance(exc, DataError):
                raise
            raise DataError(f"{path}: record {seen} is not a tf.train.Example ({exc})") from None
    if not seen:
        raise DataError(f"{path}: no records to infer the features from; give data.train.features")
    features: dict[str, dict[str, Any]] = {}
    for name in sorted(dtypes):
        found = lengths[name]
        if len(found) == 1:
            (n,) = found
            features[name] = {"dtype": dtypes[name], "shape": [] if n == 1 else [n]}
        else:
            features[name] = {"dtype": dtypes[name], "shape": [], "varlen": True}
    return features


def infer_csv(path: str, layout: CsvLayout) -> dict[str, dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    read = pacsv.ReadOptions(
        use_threads=False,
        block_size=1 << 20,
        column_names=None if layout.header else list(layout.columns or []) or None,
    )
    if not layout.header and not layout.columns:
        raise DataError(f"{path}: data.train.csv.header is false: name the columns in data.train.csv.columns")
    try:
        with open_binary(path) as raw:
            reader = pacsv.open_csv(
                raw,
                read_options=read,
                parse_options=pacsv.ParseOptions(
                    delimiter=layout.delimiter, invalid_row_handler=lambda r: "skip"
                ),
            )
            schema = reader.schema
    except pa.ArrowInvalid as exc:
        raise DataError(f"{path}: cannot infer CSV columns ({str(exc).splitlines()[0]})") from None
    features = {}
    for field in schema:
        if pa.types.is_integer(field.type) or pa.types.is_boolean(field.type):
            dtype = "int64"
        elif pa.types.is_floating(field.type) or pa.types.is_null(field.type):
            dtype = "float32"
        else:
            dtype = "bytes"
        features[field.name] = {"dtype": dtype, "shape": []}
    return features


def resolve_features(
    source: Any, files: list[str], manifest: dict[str, Any] | None, layout: CsvLayout, *, key: str
) -> dict[str, dict[str, Any]]:
    """The split's features: from the job spec, else the manifest, else inferred (and said so)."""
    from towerflow.data.csv import header_columns
    from towerflow.data.features import describe, normalize

    if source.features:
        features = normalize(
            {n: f.model_dump() for n, f in source.features.items()}, origin=f"{key}.features"
        )
    elif manifest and manifest.get("features"):
        features = normalize(manifest["features"], origin=f"manifest.json beside {files[0]}")
    else:
        raw = infer_csv(files[0], layout) if source.format == "csv" else infer_tfrecord(files[0])
        features = normalize(raw, origin=files[0])
        described = "".join(f"\n  {describe(name, spec)}" for name, spec in features.items())
        log.info("%s: no feature spec given; inferred from %s:%s", key, files[0], described)
    if source.format == "csv":
        _check_csv_columns(files[0], layout, features, header_columns(files[0], layout))
    return features


def _check_csv_columns(path: str, layout: CsvLayout, features: dict[str, Any], columns: list[str]) -> None:
    missing = [n for n in features if n not in columns]
    if missing:
        where = "header row" if layout.header else "data.train.csv.columns"
        raise DataError(f"{path}: the {where} has no column(s) {missing} (columns: {', '.join(columns)})")
    bad = [n for n, f in features.items() if f["shape"] or f["varlen"] or f["decode"]]
    if bad:
        raise DataError(f"{path}: CSV columns hold one scalar each; {bad} ask for a shape, varlen or decode")
