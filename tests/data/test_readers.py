"""Shard readers on real files, good and broken: TFRecord (batch parse, varlen, decode) and CSV."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from support import (
    example_bytes,
    flip_byte,
    tabular_header,
    tabular_rows,
    truncate,
    write_csv,
    write_examples,
)

from towerflow.data.bad_records import BadRecords
from towerflow.data.csv import CsvLayout, read_csv_file
from towerflow.data.features import normalize
from towerflow.data.tfrecord import read_tfrecord_file
from towerflow.errors import DataError

FEATURES = normalize(
    {"x": {"dtype": "float32", "shape": [2]}, "label": {"dtype": "int64"}, "example_id": {"dtype": "int64"}},
    origin="test",
)
CSV_FEATURES = normalize(
    {name: {"dtype": "int64" if name in ("example_id", "label") else "float32"} for name in tabular_header()},
    origin="test",
)


def _good(i: int) -> dict:
    return {"x": [float(i), float(-i)], "label": [i % 2], "example_id": [i]}


def _read(path, features=FEATURES, mode="error"):
    bad = BadRecords(mode)
    batches = list(read_tfrecord_file(str(path), features, bad))
    merged = {k: np.concatenate([b[k] for b in batches]) for k in features} if batches else {}
    return merged, bad


def _record_size(tmp_path) -> int:
    return len(example_bytes(_good(1))) + 16  # length, its CRC, data, data CRC


def test_tfrecord_reads_every_record_in_order(tmp_path):
    path = write_examples(tmp_path / "a", [_good(i) for i in range(5000)])  # > one read batch
    columns, _ = _read(path)
    np.testing.assert_array_equal(columns["example_id"], np.arange(5000))
    assert columns["x"].shape == (5000, 2) and columns["x"].dtype == np.float32
    np.testing.assert_array_equal(columns["x"][7], [7.0, -7.0])


def test_missing_feature_names_file_and_record(tmp_path):
    records = [_good(i) for i in range(10)]
    del records[6]["x"]
    path = write_examples(tmp_path / "a", records)
    with pytest.raises(DataError, match=r"/a: record 6: does not match the feature spec .*x"):
        _read(path)


def test_feature_default_fills_a_missing_feature(tmp_path):
    records = [_good(i) for i in range(4)]
    del records[2]["label"]
    features = normalize({**FEATURES, "label": {"dtype": "int64", "default": -1}}, origin="test")
    columns, _ = _read(write_examples(tmp_path / "a", records), features)
    assert columns["label"].tolist() == [0, 1, -1, 1]


def test_dtype_mismatch_names_the_record(tmp_path):
    records = [_good(i) for i in range(10)]
    records[3]["label"] = [0.5]  # a float where int64 is declared
    with pytest.raises(DataError, match=r"record 3: .*label"):
        _read(write_examples(tmp_path / "a", records))


def test_shape_mismatch_names_the_record(tmp_path):
    records = [_good(i) for i in range(10)]
    records[8]["x"] = [1.0, 2.0, 3.0]
    with pytest.raises(DataError, match=r"record 8: .*x"):
        _read(write_examples(tmp_path / "a", records))


def test_skip_drops_bad_records_and_counts_them(tmp_path):
    records = [_good(i) for i in range(3000)]
    records[5]["x"] = [1.0]
    del records[2500]["label"]
    columns, bad = _read(write_examples(tmp_path / "a", records), mode="skip")
    assert bad.skipped == 2 and "record 5" in bad.first_reason
    assert sorted(set(range(3000)) - set(columns["example_id"].tolist())) == [5, 2500]


def test_truncated_file_names_the_record(tmp_path):
    path = truncate(write_examples(tmp_path / "a", [_good(i) for i in range(20)]), 7)
    with pytest.raises(DataError, match=r"/a: record 19: corrupt TFRecord"):
        _read(path)


def test_corrupt_crc_names_the_record_and_skip_keeps_the_good_ones(tmp_path):
    path = write_examples(tmp_path / "a", [_good(i) for i in range(20)])
    flip_byte(path, 12 * _record_size(tmp_path) + 20)  # inside record 12's data
    with pytest.raises(DataError, match=r"record 12: corrupt TFRecord"):
        _read(path)
    columns, bad = _read(path, mode="skip")  # the length field still frames the records after it
    assert columns["example_id"].tolist() == [i for i in range(20) if i != 12] and bad.skipped == 1


def test_skip_after_a_corrupt_length_gives_up_on_the_rest_of_the_file(tmp_path):
    path = write_examples(tmp_path / "a", [_good(i) for i in range(20)])
    flip_byte(path, 5 * _record_size(tmp_path) + 2)  # record 5's length field
    columns, bad = _read(path, mode="skip")
    assert columns["example_id"].tolist() == list(range(5)) and bad.skipped == 1
    assert "record 5: corrupt TFRecord, the rest of the file is unreadable" in bad.first_reason
    truncated = truncate(write_examples(tmp_path / "b", [_good(i) for i in range(20)]), 7)
    columns, bad = _read(truncated, mode="skip")
    assert columns["example_id"].tolist() == list(range(19)) and bad.skipped == 1
    assert "the rest of the file is unreadable" in bad.first_reason


def test_decode_raw_bytes_and_wrong_size(tmp_path):
    pixels = [bytes(range(6)), bytes(range(6, 12)), bytes(5)]
    path = write_examples(tmp_path / "a", [{"image": [p], "label": [i]} for i, p in enumerate(pixels)])
    features = normalize(
        {
            "image": {"dtype": "bytes", "decode": "uint8", "decoded_shape": [2, 3]},
            "label": {"dtype": "int64"},
        },
        origin="test",
    )
    with pytest.raises(DataError, match=r"record 2: feature 'image' has 5 bytes"):
        _read(path, features)
    columns, bad = _read(path, features, mode="skip")
    assert columns["image"].shape == (2, 2, 3) and columns["image"].dtype == np.uint8
    np.testing.assert_array_equal(columns["image"][1], np.arange(6, 12).reshape(2, 3))
    assert bad.skipped == 1

    # No decoded_shape, or one with a -1: each record's length decides (it failed as "[-1, -1]").
    path = write_examples(tmp_path / "b", [{"image": [p], "label": [i]} for i, p in enumerate(pixels[:2])])
    for shape, expected in ((None, (2, 6)), ([-1, 3], (2, 2, 3))):
        spec = {"dtype": "bytes", "decode": "uint8", **({"decoded_shape": shape} if shape else {})}
        columns, _ = _read(path, normalize({"image": spec, "label": {"dtype": "int64"}}, origin="test"))
        assert columns["image"].shape == expected
        np.testing.assert_array_equal(columns["image"].reshape(2, 6)[1], np.arange(6, 12))


def test_varlen_padded_or_per_record(tmp_path):
    path = write_examples(tmp_path / "a", [{"ids": list(range(n)), "label": [n]} for n in (1, 3, 0, 5)])
    padded = normalize(
        {"ids": {"dtype": "int64", "varlen": True, "pad_to": 4, "default": -1}, "label": {"dtype": "int64"}},
        origin="test",
    )
    columns, _ = _read(path, padded)
    assert columns["ids"].tolist() == [[0, -1, -1, -1], [0, 1, 2, -1], [-1] * 4, [0, 1, 2, 3]]
    ragged = normalize(
        {"ids": {"dtype": "int64", "varlen": True}, "label": {"dtype": "int64"}}, origin="test"
    )
    columns, _ = _read(path, ragged)
    assert [list(r) for r in columns["ids"]] == [[0], [0, 1, 2], [], [0, 1, 2, 3, 4]]


# -- CSV -------------------------------------------------------------------------------------------


def _read_csv(path, mode="error", layout=None, features=CSV_FEATURES):
    bad = BadRecords(mode)
    batches = list(read_csv_file(str(path), layout or CsvLayout(), features, bad))
    return {k: np.concatenate([b[k] for b in batches]) for k in features}, bad


def test_csv_reads_typed_columns(tmp_path):
    rows = tabular_rows(100)
    columns, _ = _read_csv(write_csv(tmp_path / "a.csv", tabular_header(), rows))
    assert columns["example_id"].tolist() == list(range(100))
    assert columns["f1"].dtype == np.float32 and columns["label"].dtype == np.int64
    assert columns["f2"][10] == np.float32(float(rows[10][3]))


def test_csv_without_header_takes_column_names(tmp_path):
    path = write_csv(tmp_path / "a.csv", None, tabular_rows(10))
    columns, _ = _read_csv(path, layout=CsvLayout(header=False, columns=tuple(tabular_header())))
    assert columns["example_id"].tolist() == list(range(10))


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (lambda r: r[:-1], r"line 5: missing fields: 4 instead of 5"),
        (lambda r: [*r, 9], r"line 5: extra fields: 6 instead of 5"),
        (lambda r: [r[0], "abc", *r[2:]], r"line 5: column 'f0': 'abc' is not float32"),
        (lambda r: [r[0], "", *r[2:]], r"line 5: column 'f0' is empty and has no default"),
    ],
    ids=["missing-fields", "extra-fields", "unparseable", "empty"],
)
def test_csv_bad_row_names_file_and_line(tmp_path, broken, message):
    rows = tabular_rows(20)
    rows[3] = broken(rows[3])  # line 5: the header is line 1
    path = write_csv(tmp_path / "a.csv", tabular_header(), rows)
    with pytest.raises(DataError, match=r"a\.csv: " + message):
        _read_csv(path)
    columns, bad = _read_csv(path, mode="skip")
    assert bad.skipped == 1 and "line 5" in bad.first_reason
    assert sorted(columns["example_id"].tolist()) == [i for i in range(20) if i != 3]


def test_csv_unparseable_cell_is_named_by_the_files_column_whatever_the_specs_order(tmp_path):
    rows = tabular_rows(20)
    rows[3] = [*rows[3][:2], "abc", *rows[3][3:]]  # f1, the file's third column
    path = write_csv(tmp_path / "a.csv", tabular_header(), rows)
    features = dict(reversed(CSV_FEATURES.items()))  # label, f2, f1, f0, example_id
    with pytest.raises(DataError, match=r"a\.csv: line 5: column 'f1': 'abc' is not float32"):
        _read_csv(path, features=features)


def test_csv_text_cell_not_in_utf8_is_a_bad_row_named_by_line(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes(b"example_id,name,label\n0,abc,1\n1,\xff\xfe,0\n2,ok,1\n")
    features = normalize(
        {"example_id": {"dtype": "int64"}, "name": {"dtype": "bytes"}, "label": {"dtype": "int64"}},
        origin="test",
    )
    with pytest.raises(DataError, match=r"a\.csv: line 3: column 'name' is not UTF-8 text"):
        _read_csv(path, features=features)
    columns, bad = _read_csv(path, mode="skip", features=features)  # it raised Arrow's own error
    assert bad.skipped == 1 and bad.first_reason == "line 3: column 'name' is not UTF-8 text"
    assert columns["example_id"].tolist() == [0, 2] and columns["name"].tolist() == ["abc", "ok"]


def test_the_evaluations_reads_skip_bad_records_as_data_on_bad_record_says(tmp_path, caplog):
    """`data.on_bad_record: skip` held for the training data only: a bad record in data.eval failed
    the evaluation, and with it the run."""
    from support import blob_spec

    from towerflow.data.eval_reader import eval_source, iter_eval_batches
    from towerflow.spec import validate_spec

    path = write_examples(tmp_path / "eval-0", [_good(i) for i in range(20)])
    flip_byte(path, 12 * _record_size(tmp_path) + 20)  # inside record 12's data

    def batches(on_bad_record: str) -> list[int]:
        features = {
            "x": {"dtype": "float32", "shape": [2]},
            "label": {"dtype": "int64"},
            "example_id": {"dtype": "int64"},
        }
        evaluation = {
            "paths": str(tmp_path / "eval-*"),
            "features": features,
        }  # not inferred from the bad file
        data = {"eval": evaluation, "on_bad_record": on_bad_record}
        source = eval_source(validate_spec(blob_spec(tmp_path, data=data)))
        return [i for b in iter_eval_batches(source.files, source.reader, 8) for i in b["example_id"]]

    with pytest.raises(DataError, match=r"eval-0: record 12: corrupt TFRecord"):
        batches("error")
    with caplog.at_level(logging.WARNING, logger="towerflow"):
        assert batches("skip") == [i for i in range(20) if i != 12]
    assert "eval-0: 1 bad record(s) skipped (record 12: corrupt TFRecord" in caplog.text


def test_csv_skip_counts_every_kind_once(tmp_path):
    rows = tabular_rows(50)
    rows[1] = rows[1][:-1]
    rows[10] = [rows[10][0], "x", *rows[10][2:]]
    rows[20] = [*rows[20], 1]
    rows[30] = [rows[30][0], "", *rows[30][2:]]
    columns, bad = _read_csv(write_csv(tmp_path / "a.csv", tabular_header(), rows), mode="skip")
    assert bad.skipped == 4
    assert sorted(columns["example_id"].tolist()) == [i for i in range(50) if i not in (1, 10, 20, 30)]


def test_csv_header_without_a_spec_column_and_empty_file(tmp_path):
    path = write_csv(tmp_path / "a.csv", ["example_id", "g0", "f1", "f2", "label"], tabular_rows(3))
    with pytest.raises(DataError, match=r"a\.csv: Column 'f0' .* header lacks a column"):
        _read_csv(path)
    path.write_text("")
    with pytest.raises(DataError, match=r"a\.csv: the file is empty"):
        _read_csv(path)


@pytest.mark.parametrize("kind", ["tfrecord", "csv"])
def test_a_file_gone_since_the_start_is_named_with_the_node_that_missed_it(ray_cluster, tmp_path, kind):
    """A reader (a Ray Data task, on any node: here this process, connected to Ray as a task's is)
    that does not find a file the driver found: on a cluster without a shared disk, its node lacks
    it; the error names the file and the node."""
    import ray

    gone = str(tmp_path / f"gone.{kind}")
    with pytest.raises(DataError) as failed:
        if kind == "csv":
            list(read_csv_file(gone, CsvLayout(), CSV_FEATURES, BadRecords("error")))
        else:
            _read(gone)
    node = ray.get_runtime_context().get_node_id()
    assert str(failed.value) == (
        f"{gone}: file not found on node {ray.util.get_node_ip_address()} (Ray node {node[:12]}); the driver "
        "found it as the job started: every node that reads data needs it at this path (docs/cluster.md)"
    )
