"""The ingest path on a real Ray: epoch semantics across workers, async without stalls, bounded
readahead, inference, groups, sources on other filesystems."""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

import numpy as np
import pytest
from support import tabular_header, tabular_rows, write_csv, write_manifest, write_uneven_shards

from towerflow.data.ingest import (
    ResumePoint,
    build_training_data,
    epochs_for_steps,
    read_runs,
    read_task_placement,
    resume_point,
    steps_allowed,
)
from towerflow.errors import DataError
from towerflow.runtime.protocol import step_shape
from towerflow.spec import validate_spec

pytestmark = pytest.mark.timeout(300)

SIZES = [37, 120, 5, 64, 91]  # five shards of unequal sizes: 317 examples


def _spec(paths, *, mode="sync", workers=2, **data):
    return validate_spec(
        {
            "name": "ingest",
            "model": {"ref": "models.mlp:build", "params": {"input_dim": 4, "num_classes": 2}},
            "data": {"train": {"paths": paths}, "batch_size": 16, "shuffle_files": True, **data},
            "cluster": {"workers": workers, "ps": 1},
            "training": {"mode": mode, "max_steps": 100_000},
        }
    )


def _consume_all(ray, streams, *, batch_size, drop_last, delays=None):
    """Each stream read by its own Ray actor, concurrently (as workers do): example ids per stream."""

    def consume(stream, delay):
        ids = []
        for batch in stream.batches(batch_size=batch_size, drop_last=drop_last, shuffle_buffer=0, seed=0):
            assert len(batch["example_id"]) <= batch_size
            ids.extend(batch["example_id"].tolist())
            time.sleep(delay)
        return ids

    remote = ray.remote(num_cpus=0.25)(consume)
    delays = delays or [0.0] * len(streams)
    return ray.get([remote.remote(s, d) for s, d in zip(streams, delays)], timeout=240)


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_sync_every_example_of_every_epoch_once(ray_cluster, tmp_path, drop_remainder):
    write_uneven_shards(tmp_path, SIZES)
    workers, epochs, batch = 2, 3, 16
    spec = _spec(str(tmp_path / "train-*"), epochs=epochs, drop_remainder=drop_remainder)
    data = build_training_data(spec, workers, _shape(spec))
    per_worker = _consume_all(ray_cluster, data.splits, batch_size=batch, drop_last=drop_remainder)

    assert len(per_worker[0]) == len(per_worker[1])  # equal shares: nobody runs dry at a sync step
    counts = collections.Counter(i for ids in per_worker for i in ids)
    n = sum(SIZES)
    assert set(counts) <= set(range(n))
    assert all(c <= epochs for c in counts.values())  # never twice in one epoch
    unused = epochs * n - sum(counts.values())
    # The explicit remainder rule: only the end of the last epoch may go unused.
    assert unused <= (workers * batch - 1 if drop_remainder else workers - 1)
    assert sum(1 for i in range(n) if counts[i] < epochs) == unused


def test_async_workers_at_different_speeds_never_stall(ray_cluster, tmp_path):
    write_uneven_shards(tmp_path, SIZES)
    spec = _spec(str(tmp_path / "train-*"), mode="async", epochs=2, drop_remainder=False)
    data = build_training_data(spec, 2, _shape(spec))
    started = time.monotonic()
    fast, slow = _consume_all(ray_cluster, data.splits, batch_size=8, drop_last=False, delays=[0.0, 0.05])
    assert time.monotonic() - started < 120
    counts = collections.Counter(fast + slow)
    assert all(counts[i] == 2 for i in range(sum(SIZES)))  # async drops nothing
    assert len(fast) > len(slow)  # the fast worker was never held back to the slow one's pace


def test_readahead_stays_within_its_budget(ray_cluster, tmp_path):
    """A slow reader of 256 MiB of shards: Ray Data may not fill the object store far ahead of it."""
    import tensorflow as tf
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    from support import example_bytes

    def store_bytes() -> int:
        state = get_state_from_address(ray_cluster.get_runtime_context().gcs_address)
        return int(get_memory_info_reply(state).store_stats.object_store_bytes_used)

    payload = bytes(128 << 10)  # 128 KiB of raw float32 per record
    for s in range(32):  # 32 shards x 64 records = 256 MiB
        with tf.io.TFRecordWriter(str(tmp_path / f"train-{s:05d}-of-00016")) as writer:
            for i in range(64):
                writer.write(example_bytes({"x": [payload], "label": [0], "example_id": [s * 64 + i]}))
    features = {
        "x": {"dtype": "bytes", "decode": "float32", "decoded_shape": [32768]},
        "label": {"dtype": "int64"},
        "example_id": {"dtype": "int64"},
    }
    budget_mb = 16
    spec = _spec(str(tmp_path / "train-*"), workers=1, epochs=1, readahead_mb=budget_mb)
    spec.data.train.features = validate_spec(
        {**spec.model_dump(), "data": {"train": {"paths": "x", "features": features}}}
    ).data.train.features
    data = build_training_data(spec, 1, _shape(spec))
    baseline = store_bytes()
    samples = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(store_bytes() - baseline)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        (ids,) = _consume_all(ray_cluster, data.splits, batch_size=16, drop_last=False, delays=[0.05])
    finally:
        stop.set()
        sampler.join()
    assert sorted(ids) == list(range(32 * 64))
    peak_mb = max(samples) / 2**20
    # The budget plus blocks in flight (a parse task's output, the split's buffer, prefetched batches),
    # however much data there is: measured 52-68 MiB here with the 16 MiB budget (over 128 and 256
    # MiB of shards), against 128 and 200 MiB with a 4 GiB budget.
    assert peak_mb < 112, f"object store peaked at {peak_mb:.1f} MiB"


def test_csv_with_groups_and_inferred_columns(ray_cluster, tmp_path, caplog):
    write_csv(tmp_path / "train-00000-of-00002.csv", tabular_header(), tabular_rows(30))
    write_csv(tmp_path / "train-00001-of-00002.csv", tabular_header(), tabular_rows(20, start_id=30))
    spec = _spec(str(tmp_path / "train-*.csv"), workers=1, epochs=1, drop_remainder=False)
    spec.data.train.format = "csv"
    spec.data.train.groups = {"features": ["f*"]}
    with caplog.at_level(logging.INFO, logger="towerflow"):
        data = build_training_data(spec, 1, _shape(spec))
    printed = caplog.text
    assert "inferred from" in printed and "f0: float32 []" in printed and "example_id: int64 []" in printed
    assert data.groups == {"features": ["f0", "f1", "f2"]}
    batch = next(data.splits[0].batches(batch_size=64, drop_last=False, shuffle_buffer=0, seed=0))
    assert set(batch) == {"features", "label", "example_id"}
    assert batch["features"].shape == (50, 3) and batch["features"].dtype == np.float32


def test_manifest_csv_settings_and_file_urls(ray_cluster, tmp_path):
    header = tabular_header()
    write_csv(tmp_path / "train-00000-of-00001.csv", None, [r for r in tabular_rows(12)])
    manifest = {
        "name": "tabular",
        "format": "csv",
        "label": "label",
        "csv": {"header": False, "delimiter": ","},
        "splits": {"train": {"files": ["train-00000-of-00001.csv"], "examples": 12, "per_file": [12]}},
        "features": {
            name: {"dtype": "int64" if name in ("example_id", "label") else "float32", "shape": []}
            for name in header
        },
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    spec = _spec(f"file://{tmp_path}/train-*.csv", workers=1, epochs=1, drop_remainder=False)
    spec.data.train.format = "csv"  # no header, no csv.columns: the manifest's features give them
    data = build_training_data(spec, 1, _shape(spec))
    assert data.examples_per_epoch == 12
    batch = next(data.splits[0].batches(batch_size=64, drop_last=False, shuffle_buffer=0, seed=0))
    assert sorted(batch["example_id"].tolist()) == list(range(12))


def test_seeded_shuffles_repeat_and_differ_per_epoch(ray_cluster, tmp_path):
    """deterministic: true keeps block order, so file-order shuffle + seeded buffer give one order."""
    write_uneven_shards(tmp_path, SIZES)

    def order(seed):
        spec = _spec(str(tmp_path / "train-*"), workers=1, epochs=2, deterministic=True, seed=seed)
        (stream,) = build_training_data(spec, 1, _shape(spec)).splits
        ids = []
        for batch in stream.batches(batch_size=16, drop_last=False, shuffle_buffer=64, seed=seed):
            ids.extend(batch["example_id"].tolist())
        return ids

    first, again, other = order(1), order(1), order(2)
    n = sum(SIZES)
    assert first == again and first != other
    assert sorted(first[:n]) != first[:n]  # shuffled
    assert first[:n] != first[n:]  # a different order in the second epoch


def _shape(spec):
    return step_shape(spec.training.mode, spec.replicas_to_aggregate)


def _allowed(spec, workers: int, examples: int) -> int:
    return steps_allowed(spec, workers, examples, _shape(spec))


def test_steps_the_data_allows():
    def spec(mode="sync", workers=2, drop_remainder=True, **training):
        raw = _spec("x", mode=mode, workers=workers, drop_remainder=drop_remainder)
        return raw.model_copy(update={"training": raw.training.model_copy(update=training)})

    # Sync: equal shares (1,000 / 2 = 500 each), whole batches of 16 (31 each), one update per round.
    assert _allowed(spec(), 2, 1000) == 31
    assert _allowed(spec(drop_remainder=False), 2, 1000) == 32  # 31 full batches and one of 4
    # Backup workers: 3 workers x 20 batches (333 each), 2 gradients an update.
    assert _allowed(spec(workers=3, replicas_to_aggregate=2), 3, 1000) == 30
    # Async: every batch is an update; each worker's last partial batch is dropped, or one more.
    assert _allowed(spec("async"), 2, 1000) == 62
    assert _allowed(spec("async", drop_remainder=False), 2, 1000) == 64


def test_epochs_planned_for_max_steps_count_an_async_step_as_one_batch():
    # 100 steps of batch 16 over 1,000-example epochs, and one epoch more. A sync step takes a
    # batch from each of the 2 workers (3,200 examples: 4 epochs); an async step is one worker's
    # batch (1,600: 2 epochs). Planning the sync count for async kept Ray Data reading all run.
    def planned(mode):
        spec = _spec("x", mode=mode, workers=2)
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"max_steps": 100})})
        return epochs_for_steps(spec, 1000, 2, _shape(spec))

    assert planned("sync") == 5
    assert planned("async") == 3

    # Re-planned after a shrink from 4 workers to 1 at 3,200 examples (step 50 of 100): planned
    # from the run's start for one worker (1,600 examples: 3 epochs), the data would end in epoch 3
    # at step 75, the run FINISHED short of max_steps; the epochs read already count on top.
    spec = _spec("x", mode="sync", workers=1)
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"max_steps": 100})})
    assert epochs_for_steps(spec, 1000, 1, _shape(spec)) == 3
    assert epochs_for_steps(spec, 1000, 1, _shape(spec), examples_seen=3200) == 6  # 4,800 examples, and one


def test_file_reads_are_cut_into_runs_that_start_small():
    # One read task a file while there are few; beyond the cap, runs that double from one file up
    # to an even share, so the first batch waits for one file and Ray Data plans at most 8 blocks.
    few = [f"f{i}" for i in range(8)]
    assert read_runs(few, max_blocks=8) == [[path] for path in few]
    many = [f"f{i}" for i in range(1000)]
    runs = read_runs(many, max_blocks=8)
    assert [path for run in runs for path in run] == many  # every read, once, in order
    assert [len(run) for run in runs] == [1, 2, 4, 8, 16, 32, 64, 873]
    runs = read_runs(many, max_blocks=100)
    assert len(runs) == 100 and [len(run) for run in runs[:5]] == [1, 2, 4, 8, 11]
    assert max(len(run) for run in runs) - min(len(run) for run in runs[4:]) <= 1  # then even


def test_reads_one_at_a_time_stay_where_ray_places_tasks_by_default_and_more_spread():
    # One read at a time gains nothing from Ray Data's SPREAD, which started a reader (importing
    # TensorFlow) on every node in turn (tests/runtime/test_multinode_cluster.py checks the node).
    assert read_task_placement(data_cpus=0.5, task_cpus=0.5) == {"scheduling_strategy": "DEFAULT"}
    assert read_task_placement(data_cpus=1.5, task_cpus=1.0) == {"scheduling_strategy": "DEFAULT"}
    assert read_task_placement(data_cpus=2.0, task_cpus=1.0) == {}  # Ray Data's own: SPREAD


def test_resume_point_skips_whole_epochs_then_whole_files():
    orders = [["a", "b", "c"], ["c", "a", "b"]]  # epoch 2 reads its files in another order
    counts = {"a": 10, "b": 20, "c": 5}  # 35 examples an epoch
    assert resume_point(orders, counts, 0) == ResumePoint(0, 0, 0)
    assert resume_point(orders, counts, 29) == ResumePoint(0, 1, 10)  # b only partly trained: read again
    assert resume_point(orders, counts, 30) == ResumePoint(0, 2, 30)
    assert resume_point(orders, counts, 35 + 15) == ResumePoint(1, 2, 50)  # c and a of epoch 2
    assert resume_point(orders, counts, 70) == ResumePoint(2, 0, 70)  # every epoch done


def _write_uneven_shards_with_manifest(folder) -> None:
    """SIZES as shards, and a manifest with their per-file counts (so the data position is known)."""
    paths = write_uneven_shards(folder, SIZES)
    write_manifest(folder, "uneven", [p.name for p in paths], SIZES, dim=4)


def test_a_batch_larger_than_the_data_allows_no_step_and_is_named(ray_cluster, tmp_path):
    # 317 examples x 2 epochs over 2 workers: 317 each, less than one whole batch of 400; with 300, one
    # batch each, which make one sync update.
    _write_uneven_shards_with_manifest(tmp_path)
    spec = _spec(str(tmp_path / "train-*"), workers=2, epochs=2, batch_size=400)
    with pytest.raises(
        DataError, match=r"data.batch_size: 400 examples per worker make no training step out of the 634 "
    ):
        build_training_data(spec, 2, _shape(spec))
    smaller = spec.model_copy(update={"data": spec.data.model_copy(update={"batch_size": 300})})
    assert (
        build_training_data(smaller, 2, _shape(smaller)).steps == 1
    )  # one sync step of both workers' batches


def test_resumed_stream_starts_after_the_examples_seen(ray_cluster, tmp_path):
    # Unshuffled, with a manifest: epoch 1 (317 examples) and the first file of epoch 2 (37) were
    # trained, and 50 of the second file's 120: the resumed stream reads that file again, then the rest.
    _write_uneven_shards_with_manifest(tmp_path)
    spec = _spec(str(tmp_path / "train-*"), workers=2, epochs=2, shuffle_files=False, drop_remainder=False)
    seen = sum(SIZES) + SIZES[0] + 50
    data = build_training_data(spec, 2, _shape(spec), examples_seen=seen)
    assert (
        "epoch 2 of 2, after 1 file(s)" in data.resume_note
        and f"{sum(SIZES) + SIZES[0]} of {seen}" in data.resume_note
    )
    # The run counts on from where the stream starts, the re-read file's start: counted on from
    # `seen`, it would be 50 examples ahead of the data, and a re-plan 70 examples on (the
    # re-read file's 120 not all read) would skip to the next file, its last 50 never trained.
    assert data.position == sum(SIZES) + SIZES[0]
    per_worker = _consume_all(ray_cluster, data.splits, batch_size=16, drop_last=False)
    read = sorted(i for ids in per_worker for i in ids)
    rest = list(range(SIZES[0], sum(SIZES)))  # every file of epoch 2 but the first, once
    assert len(set(read)) == len(read) >= len(rest) - 1  # once each; the equal split may leave one out
    assert set(read) <= set(rest)

    done = sum(SIZES) * 2
    with pytest.raises(DataError, match=r"nothing left to read.*all 2 epoch\(s\).*Raise data.epochs"):
        build_training_data(spec, 2, _shape(spec), examples_seen=done)
