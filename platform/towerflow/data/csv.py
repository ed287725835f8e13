"""Read CSV shards with pyarrow's streaming CSV reader (vectorized, C++), inside Ray Data tasks.

Rows with too few or too many fields are caught by pyarrow's invalid-row handler; unparseable
values and empty cells without a default are found per column. Either names the file and the line
(on_bad_record: error) or drops the row and counts it (skip).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from towerflow.data.bad_records import BadRecords
from towerflow.data.sources import open_binary
from towerflow.errors import DataError

BLOCK_BYTES = 4 << 20
_ARROW_TYPES = {"int64": "int64", "float32": "float32", "bytes": "string"}


@dataclass(frozen=True)
class CsvLayout:
    header: bool = True
    delimiter: str = ","
    columns: tuple[str, ...] | None = None  # every column in file order, when the file has no header


class _InvalidRows:
    """pyarrow's invalid-row handler: remembers the first bad row (error) or skips and counts."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.lines: list[int] = []
        self.first: str | None = None

    def __call__(self, row) -> str:
        what = "missing fields" if row.actual_columns < row.expected_columns else "extra fields"
        reason = f"{what}: {row.actual_columns} instead of {row.expected_columns} ({row.text[:120]!r})"
        self.first = self.first or f"line {row.number}: {reason}"
        if row.number is not None:
            self.lines.append(int(row.number))
        return "skip" if self.skip else "error"


def read_csv_file(
    path: str, layout: CsvLayout, features: dict[str, dict[str, Any]], bad: BadRecords | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Yield column batches of one CSV file, typed by the feature spec."""
    import pyarrow as pa

    bad = bad or BadRecords()
    skip = bad.mode == "skip"
    invalid = _InvalidRows(skip)
    consumed = 0  # data rows (after skipped invalid rows) already handed on
    try:
        with open_binary(path) as raw:
            reader = _open(path, raw, layout, features, invalid, typed=True)
            for batch in reader:
                columns = _finish(path, batch, consumed, layout, features, bad, invalid.lines)
                consumed += batch.num_rows
                if columns is not None:
                    yield columns
    except pa.ArrowInvalid as exc:
        if invalid.first and not skip:
            raise DataError(f"{path}: {invalid.first}") from None
        if not skip:
            raise DataError(f"{path}: {_conversion_message(exc, path, features, layout)}") from None
        invalid = _InvalidRows(skip=True)  # the string read below sees every invalid row again
        yield from _untyped_rest(path, layout, features, bad, invalid, consumed)
    if invalid.lines:
        bad.bad(path, f"line {invalid.lines[0]}", invalid.first or "bad row", count=len(invalid.lines))


def _open(path: str, raw, layout: CsvLayout, features, invalid: _InvalidRows, *, typed: bool):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    names = list(layout.columns) if layout.columns else None
    read = pacsv.ReadOptions(
        use_threads=False,
        block_size=BLOCK_BYTES,
        column_names=None if layout.header else (names or list(features)),
    )
    parse = pacsv.ParseOptions(delimiter=layout.delimiter, invalid_row_handler=invalid)
    # Untyped (skip mode's second read): bytes, so that a cell not in UTF-8 is one bad row, not the file's end
    types = {
        n: (getattr(pa, _ARROW_TYPES[f["dtype"]])() if typed else pa.binary()) for n, f in features.items()
    }
    convert = pacsv.ConvertOptions(
        column_types=types,
        include_columns=list(features),
        null_values=[""],
        strings_can_be_null=not typed,
        quoted_strings_can_be_null=False,
    )
    try:
        return pacsv.open_csv(raw, read_options=read, parse_options=parse, convert_options=convert)
    except (pa.ArrowInvalid, pa.ArrowKeyError) as exc:
        text = str(exc)
        if "Empty CSV" in text or "No columns" in text:
            raise DataError(f"{path}: the file is empty (no header row)") from None
        if "include_columns" in text:
            raise DataError(
                f"{path}: {text.splitlines()[0]}: its header lacks a column the feature spec names "
                f"({', '.join(features)}); fix the header, or set csv.header: false with csv.columns"
            ) from None
        raise


def _finish(
    path, batch, first, layout, features, bad: BadRecords, skipped_lines
) -> dict[str, np.ndarray] | None:
    """Arrow batch to NumPy columns; empty cells take the feature's default or are bad rows."""
    keep = np.ones(batch.num_rows, dtype=bool)
    columns = {}
    for name, spec in features.items():
        column = batch.column(name)
        if column.null_count:
            nulls = np.asarray(column.is_null())
            if spec.get("default") is not None:
                column = column.fill_null(spec["default"])
            else:
                for i in np.flatnonzero(nulls & keep):
                    line = _line_of(first + int(i), layout, skipped_lines)
                    bad.bad(path, f"line {line}", f"column {name!r} is empty and has no default")
                keep &= ~nulls
                column = column.fill_null(0 if spec["dtype"] != "bytes" else "")
        columns[name] = column.to_numpy(zero_copy_only=False)
    if not keep.all():
        if not keep.any():
            return None
        columns = {k: v[keep] for k, v in columns.items()}
    return columns


def _untyped_rest(path, layout, features, bad: BadRecords, invalid, start: int):
    """Skip mode after a value failed to convert: read the file as strings, drop bad values, cast."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with open_binary(path) as raw:
        table = _open(path, raw, layout, features, invalid, typed=False).read_all().slice(start)
    keep = np.ones(table.num_rows, dtype=bool)
    typed = {}
    for name, spec in features.items():
        column = _as_text(path, name, table.column(name), keep, start, layout, invalid, bad)
        if spec["dtype"] == "bytes":
            typed[name] = column.fill_null("")
            continue
        target = getattr(pa, _ARROW_TYPES[spec["dtype"]])()
        try:
            typed[name] = pc.cast(column, target)
            continue
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        values = column.to_pylist()  # error path only: find which cells do not parse
        cast = []
        for i, value in enumerate(values):
            try:
                cast.append(None if value is None else pc.cast(pa.scalar(value), target).as_py())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                cast.append(None)
                if keep[i]:
                    line = _line_of(start + i, layout, invalid.lines)
                    bad.bad(path, f"line {line}", f"column {name!r}: {value!r} is not {spec['dtype']}")
                keep[i] = False
        typed[name] = pa.chunked_array([pa.array(cast, type=target)])
    batch = pa.table(typed).combine_chunks().to_batches()
    for part in batch:
        mask = keep[: part.num_rows]
        keep = keep[part.num_rows :]
        columns = _finish(path, part.filter(pa.array(mask)), start, layout, features, bad, invalid.lines)
        if columns is not None:
            yield columns


def _as_text(path, name, column, keep, start, layout, invalid, bad: BadRecords):
    """A column read as bytes, as text; a cell not in UTF-8 makes its row a bad one (and null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        return pc.cast(column, pa.string())
    except pa.ArrowInvalid:
        pass
    cells = []
    for i, value in enumerate(column.to_pylist()):  # error path only: find which cells are not text
        try:
            cells.append(None if value is None else value.decode("utf-8"))
        except UnicodeDecodeError:
            cells.append(None)
            if keep[i]:
                line = _line_of(start + i, layout, invalid.lines)
                bad.bad(path, f"line {line}", f"column {name!r} is not UTF-8 text")
            keep[i] = False
    return pa.chunked_array([pa.array(cells, type=pa.string())])


def _line_of(row: int, layout: CsvLayout, skipped_lines: list[int]) -> int:
    """The 1-based line of the file's `row`-th kept data row (no quoted line breaks assumed)."""
    line = row + 1 + (1 if layout.header else 0)
    for skipped in sorted(skipped_lines):
        if skipped <= line:
            line += 1
    return line


_CONVERSION = re.compile(
    r"In CSV column #(\d+): Row #(\d+): CSV conversion error to (\w+): invalid (?:value '(.*)'|(UTF8) data)"
)


def _conversion_message(exc: Exception, path: str, features, layout: CsvLayout) -> str:
    text = str(exc).strip().splitlines()[0]
    found = _CONVERSION.search(text)
    if not found:
        return f"cannot parse ({text[:300]})"
    index, line, _, value, not_text = found.groups()
    try:  # Arrow numbers the file's columns, not the feature spec's
        names = header_columns(path, layout)
    except Exception:
        names = []
    name = names[int(index)] if int(index) < len(names) else f"#{index}"
    if not_text:
        return f"line {line}: column {name!r} is not UTF-8 text"
    return f"line {line}: column {name!r}: {value!r} is not {features.get(name, {}).get('dtype', 'valid')}"


def header_columns(path: str, layout: CsvLayout) -> list[str]:
    """The file's column names: its header row, or the layout's columns."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if not layout.header:
        if not layout.columns:
            raise DataError(
                f"{path}: data.train.csv.header is false: name the columns in data.train.csv.columns"
            )
        return list(layout.columns)
    with open_binary(path) as raw:
        try:
            reader = pacsv.open_csv(
                raw,
                read_options=pacsv.ReadOptions(use_threads=False, block_size=1 << 16),
                parse_options=pacsv.ParseOptions(
                    delimiter=layout.delimiter, invalid_row_handler=lambda r: "skip"
                ),
                convert_options=pacsv.ConvertOptions(column_types={}),
            )
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path}: cannot read a CSV header ({str(exc).splitlines()[0]})") from None
        return list(reader.schema.names)
