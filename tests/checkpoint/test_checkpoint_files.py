"""Checkpoint state and files: whole variables from shard pieces and back, atomic writes, retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support import sqlite_store

from towerflow.checkpoint import (
    TrainingState,
    assemble_state,
    read_checkpoint,
    split_for_shards,
    write_checkpoint,
)
from towerflow.checkpoint.files import (
    MODEL_PART,
    PartLayout,
    checkpoint_meta,
    checkpoint_name,
    checkpoint_step,
    read_meta,
    shard_part_name,
    write_part,
)
from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.checkpoint.retention import checkpoints_to_delete
from towerflow.checkpoint.stores import LocalCheckpointStore, latest_step
from towerflow.runtime.shard_parts import ShardSnapshot
from towerflow.runtime.sharding import GreedyBytes, cut_variables, shard_variables
from towerflow.shared_types import VariableInfo


def _variables():
    shapes = {"dense/kernel": (40, 8), "dense/bias": (8,), "out/kernel": (8, 3), "scale": ()}
    rng = np.random.default_rng(0)
    infos, values = [], []
    for i, (name, shape) in enumerate(shapes.items()):
        value = rng.normal(size=shape).astype(np.float32)
        infos.append(VariableInfo(i, name, shape, "float32", value.nbytes))
        values.append(value)
    return infos, values


def _snapshots(infos, values, num_shards, version=7):
    pieces = cut_variables(infos, num_shards, min_slice_bytes=256)
    assignment = shard_variables(GreedyBytes(), pieces, num_shards)
    snapshots = [
        ShardSnapshot(
            shard,
            version,
            [pieces[i].name for i in indices],
            [np.array(pieces[i].of(values[pieces[i].variable])) for i in indices],
            {"m": [np.array(pieces[i].of(values[pieces[i].variable])) * 2 for i in indices]},
        )
        for shard, indices in enumerate(assignment)
    ]
    return pieces, assignment, snapshots


def test_state_round_trips_through_pieces_onto_another_shard_count():
    infos, values = _variables()
    pieces, assignment, snapshots = _snapshots(infos, values, num_shards=3)
    assert any(p.name.endswith("part_1") for p in pieces)  # the big kernel really was cut
    state = assemble_state(snapshots, infos, pieces, assignment, "adam", {"examples_seen": 64})
    assert state.global_step == 7 and state.names == [i.name for i in infos]
    for info, value in zip(infos, values):
        np.testing.assert_array_equal(state.variables[info.name], value)
        np.testing.assert_array_equal(state.slots["m"][info.name], value * 2)

    new_pieces = cut_variables(infos, 2, min_slice_bytes=256)
    new_assignment = shard_variables(GreedyBytes(), new_pieces, 2)
    per_shard = split_for_shards(state, infos, new_pieces, new_assignment, "adam")
    for indices, (shard_values, shard_slots) in zip(new_assignment, per_shard):
        for index, value, slot in zip(indices, shard_values, shard_slots["m"]):
            expected = new_pieces[index].of(values[new_pieces[index].variable])
            np.testing.assert_array_equal(value, expected)
            np.testing.assert_array_equal(slot, expected * 2)
    # Another optimizer: values restored, slots start fresh.
    assert all(
        slots is None for _, slots in split_for_shards(state, infos, new_pieces, new_assignment, "sgd")
    )


def test_shards_at_different_versions_are_not_a_checkpoint():
    infos, values = _variables()
    pieces, assignment, snapshots = _snapshots(infos, values, num_shards=2)
    snapshots[1].version = 8
    with pytest.raises(ValueError, match="different versions"):
        assemble_state(snapshots, infos, pieces, assignment, "adam")


def test_a_model_that_does_not_fit_the_checkpoint_is_named():
    infos, values = _variables()
    pieces, assignment, snapshots = _snapshots(infos, values, num_shards=1)
    state = assemble_state(snapshots, infos, pieces, assignment, "adam")
    other = [VariableInfo(0, "dense/kernel", (41, 8), "float32", 41 * 32), *infos[1:]]
    with pytest.raises(ValueError, match=r"dense/kernel: the checkpoint holds shape \(40, 8\)"):
        split_for_shards(state, other, cut_variables(other, 1, None), [[0, 1, 2, 3]], "adam")


def test_files_round_trip_and_are_tensorflow_checkpoints(tmp_path):
    import tensorflow as tf

    state = TrainingState(
        12,
        "adam",
        ["a/kernel", "b"],
        {"a/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.full((), 3.0, np.float32)},
        {"m": {"a/kernel": np.ones((2, 3), np.float32), "b": np.zeros((), np.float32)}},
        {"examples_seen": 384},
    )
    directory = write_checkpoint(state, tmp_path)
    assert directory.name == "ckpt-000000012"
    back = read_checkpoint(directory)
    assert (
        back.global_step == 12 and back.names == state.names and back.data_position == {"examples_seen": 384}
    )
    np.testing.assert_array_equal(back.variables["a/kernel"], state.variables["a/kernel"])
    np.testing.assert_array_equal(back.slots["m"]["a/kernel"], state.slots["m"]["a/kernel"])
    names = dict(tf.train.list_variables(str(directory / "shard-00000" / "state")))
    assert names["values/0/.ATTRIBUTES/VARIABLE_VALUE"] == [2, 3]  # readable by plain TF tools
    assert read_meta(directory)["parts"] == [
        {"name": "shard-00000", "pieces": [["a/kernel", 0, 2], ["b", 0, 1]]}
    ]


def test_a_step_saved_again_replaces_the_first_whole_and_leaves_nothing_aside(tmp_path):
    def state(value: float) -> TrainingState:
        return TrainingState(5, "sgd", ["w"], {"w": np.full(3, value, np.float32)}, {}, {})

    write_checkpoint(state(1.0), tmp_path)
    directory = write_checkpoint(state(2.0), tmp_path)  # the old one moved aside, then removed
    np.testing.assert_array_equal(read_checkpoint(directory).variables["w"], np.full(3, 2.0, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == [directory.name]


def _write_in_parts(store, infos, values, num_shards, step=7, model_state=None):
    """A checkpoint written as the shards write it: one part each, through the store's writer,
    then meta.json. Returns the writer (committed)."""
    pieces, assignment, snapshots = _snapshots(infos, values, num_shards, version=step)
    writer = store.writer(step)
    layouts = []
    for shard, (indices, snapshot) in enumerate(zip(assignment, snapshots)):
        name = shard_part_name(shard)
        with tempfile.TemporaryDirectory() as scratch:
            write_part(scratch, snapshot.values, [snapshot.slots["m"]])
            writer.write_part(name, scratch)
        layouts.append(
            PartLayout(
                name,
                tuple((infos[pieces[i].variable].name, pieces[i].start, pieces[i].stop) for i in indices),
            )
        )
    assert store.list() == []  # nothing complete before meta.json
    if model_state:
        with tempfile.TemporaryDirectory() as scratch:
            write_part(scratch, list(model_state.values()), [])
            writer.write_part(MODEL_PART, scratch)
    meta = checkpoint_meta(
        step,
        "adam",
        [(i.name, i.shape, i.dtype) for i in infos],
        ["m"],
        layouts,
        model_state,
        {"examples_seen": 640},
    )
    writer.commit(meta)
    return pieces, assignment


def _check_reads_back(store, infos, values, pieces, assignment):
    ((step, _),) = store.list()
    opened = store.open(step)
    assert opened.global_step == 7 and opened.examples_seen == 640 and opened.slot_names == ["m"]
    np.testing.assert_array_equal(opened.model_state["bn/mean"], np.arange(3, dtype=np.float32))
    for shard, indices in enumerate(assignment):  # what a shard reads of its own part
        part_values, (part_m,) = opened.read_part(shard_part_name(shard))
        for index, value, slot in zip(indices, part_values, part_m):
            expected = pieces[index].of(values[pieces[index].variable])
            np.testing.assert_array_equal(value, expected)
            np.testing.assert_array_equal(slot, expected * 2)
    whole = store.load(step)  # joined part by part
    for info, value in zip(infos, values):
        np.testing.assert_array_equal(whole.variables[info.name], value)
        np.testing.assert_array_equal(whole.slots["m"][info.name], value * 2)
    assert whole.model_state.keys() == {"bn/mean"}


def test_a_checkpoint_written_in_parts_reads_back_whole_and_part_by_part(tmp_path):
    infos, values = _variables()
    store = LocalCheckpointStore(tmp_path)
    pieces, assignment = _write_in_parts(
        store, infos, values, 3, model_state={"bn/mean": np.arange(3, dtype=np.float32)}
    )
    assert any(p.name.endswith("part_1") for p in pieces)
    _check_reads_back(store, infos, values, pieces, assignment)
    assert sorted(p.name for p in (tmp_path / "ckpt-000000007").iterdir()) == [
        "meta.json",
        "model",
        "shard-00000",
        "shard-00001",
        "shard-00002",
    ]


def _mlflow_store(tmp_path) -> MlflowCheckpointStore:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(sqlite_store(tmp_path))
    experiment = client.create_experiment("parts", artifact_location=(tmp_path / "artifacts").as_uri())
    return MlflowCheckpointStore(client, client.create_run(experiment).info.run_id)


def test_a_checkpoint_written_in_parts_to_an_mlflow_run(tmp_path):
    infos, values = _variables()
    store = _mlflow_store(tmp_path)
    pieces, assignment = _write_in_parts(
        store, infos, values, 2, model_state={"bn/mean": np.arange(3, dtype=np.float32)}
    )
    _check_reads_back(store, infos, values, pieces, assignment)
    store.delete(7)
    assert store.list() == []


@pytest.mark.parametrize("kind", ["local", "mlflow"])
def test_checkpoints_begun_and_never_finished_are_pruned_once_a_later_one_is_complete(tmp_path, kind):
    """What a write cut short leaves (an outage, a killed driver): parts and no meta.json."""
    store = LocalCheckpointStore(tmp_path / "local") if kind == "local" else _mlflow_store(tmp_path)
    for step in (5, 9):
        writer = store.writer(step)
        with tempfile.TemporaryDirectory() as scratch:
            write_part(scratch, [np.ones(2, np.float32)], [])
            writer.write_part(shard_part_name(0), scratch)
    infos, values = _variables()
    _write_in_parts(store, infos, values, 2)  # step 7, complete
    assert store.prune_unfinished(before=7) == [5]  # 9 may be a write under way
    assert store.prune_unfinished(before=10) == [9] and store.prune_unfinished(before=10) == []
    assert [step for step, _ in store.list()] == [7]
    if kind == "local":
        left = [path.name for path in store.directory.iterdir()]
    else:
        left = [Path(e.path).name for e in store.repository.list_artifacts("checkpoints")]
    assert left == [checkpoint_name(7)]


def test_checkpoint_directory_names_give_their_step():
    assert checkpoint_step(checkpoint_name(7)) == 7
    assert checkpoint_step(".tmp-ckpt-000000012-1a2b3c4d") == 12  # a staging directory
    assert [checkpoint_step(n) for n in ("meta.json", ".tmp-12", "ckpt-", "ckpt-x", "model")] == [None] * 5


def test_an_aborted_checkpoint_leaves_nothing(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    writer = store.writer(3)
    with tempfile.TemporaryDirectory() as scratch:
        write_part(scratch, [np.ones(2, np.float32)], [])
        writer.write_part(shard_part_name(0), scratch)
    writer.abort()
    assert store.list() == [] and list(tmp_path.iterdir()) == []


def test_format_1_checkpoints_still_read(tmp_path):
    """Checkpoints written before shards wrote their own parts: one TF checkpoint of whole variables."""
    from towerflow.checkpoint.files import _format_1_object

    state = TrainingState(5, "sgd", ["w"], {"w": np.arange(4, dtype=np.float32)}, {}, {"examples_seen": 10})
    directory = tmp_path / "ckpt-000000005"
    directory.mkdir()
    _format_1_object(state).write(str(directory / "state"))
    meta = {
        "format": 1,
        "global_step": 5,
        "optimizer": "sgd",
        "variables": [{"name": "w", "shape": [4], "dtype": "float32"}],
        "slots": [],
        "data_position": {"examples_seen": 10},
        "written_at": 1.0,
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    opened = LocalCheckpointStore(tmp_path).open(5)
    assert opened.parts == [] and opened.examples_seen == 10
    np.testing.assert_array_equal(opened.read().variables["w"], state.variables["w"])


def test_a_writer_killed_mid_write_leaves_nothing_a_resume_would_pick(tmp_path):
    """A real process writing a big checkpoint is killed at random points; the store only ever
    lists complete checkpoints, and each one it lists reads back."""
    store = LocalCheckpointStore(tmp_path)
    store.save(TrainingState(1, "sgd", ["w"], {"w": np.ones(4, np.float32)}, {}))
    script = textwrap.dedent(
        f"""
        import numpy as np
        from towerflow.checkpoint import TrainingState, write_checkpoint
        big = np.ones((4096, 4096), np.float32)
        for step in range(2, 200):
            write_checkpoint(TrainingState(step, "sgd", ["w"], {{"w": big}}, {{}}), {str(tmp_path)!r})
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for delay in (1.5, 2.5, 3.5):
        writer = subprocess.Popen([sys.executable, "-c", script], env=env)
        try:
            writer.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
        steps = [step for step, _ in store.list()]
        assert latest_step(store) == max(steps)
        state = store.load(max(steps))
        assert state.global_step == max(steps) and state.variables["w"].dtype == np.float32
    assert store.prune_unfinished(before=200)  # what a save after these writers does
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(s) for s, _ in store.list()]


def test_retention_keeps_newest_and_one_every_n_hours():
    hour = 3600.0
    checkpoints = [(step, step * 0.5 * hour) for step in range(1, 11)]  # one every half hour
    assert checkpoints_to_delete(checkpoints, 5, None, started_at=0.0) == [1, 2, 3, 4, 5]
    # Newest 3 stay (8, 9, 10); of the older ones, step 4 (2 h after the start) is kept for good.
    assert checkpoints_to_delete(checkpoints, 3, 2.0, started_at=0.0) == [1, 2, 3, 5, 6, 7]
    assert checkpoints_to_delete(checkpoints[:3], 5, None, started_at=0.0) == []
    # Resumed 5 h in: the first driver left 4 (kept for good) and its window 8, 9, 10; the new one
    # saves 11 and 12. Judged from the new driver's start, step 4 would go too; given as kept for
    # good, it stays, and the window's older steps go as a new tf.train.Saver's would.
    resumed = [c for c in checkpoints if c[0] in (4, 8, 9, 10)] + [(11, 5.5 * hour), (12, 6.0 * hour)]
    assert checkpoints_to_delete(resumed, 3, 2.0, started_at=5.0 * hour) == [4, 8, 9]
    assert checkpoints_to_delete(resumed, 3, 2.0, started_at=5.0 * hour, kept_for_good={4}) == [8, 9]
