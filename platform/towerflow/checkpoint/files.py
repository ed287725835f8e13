"""One checkpoint on disk: a directory of parts plus `meta.json`, written atomically.

A checkpoint is a directory `ckpt-<step>`. Each part is a `tf.train.Checkpoint` of some variable
pieces and their optimizer slots: one part per parameter-server shard, written by that shard, and
a `model` part for the model's non-trainable state. `meta.json` says which rows of which variable
each part holds, so a checkpoint joins back into whole variables and restores onto any number of
shards. A local checkpoint is built under a hidden temporary name and renamed into place only when
complete, and `meta.json` (what a reader looks for first) is its last file, so a crash mid-write
never leaves a directory that restore would pick and then fail on.

Format 1 (one `tf.train.Checkpoint` of whole variables, written by the driver) is still read.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.checkpoint.state import TrainingState

META = "meta.json"
CHECKPOINT_PREFIX = "ckpt-"
STAGING_PREFIX = ".tmp-"
PREFIX = "state"  # tf.train.Checkpoint file prefix inside a part's directory
FORMAT_VERSION = 2
MODEL_PART = "model"  # the model's non-trainable state (batch-norm statistics)


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:09d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint's directory (`ckpt-<step>`) or of its staging directory
    (`.tmp-ckpt-<step>-<id>`, `staging_directory`) by its name; None for any other name."""
    rest = name.removeprefix(STAGING_PREFIX)
    if not rest.startswith(CHECKPOINT_PREFIX):
        return None
    digits = rest[len(CHECKPOINT_PREFIX) :].split("-", 1)[0]
    return int(digits) if digits.isdigit() else None


def shard_part_name(shard: int) -> str:
    return f"shard-{shard:05d}"


# -- parts -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartLayout:
    """What one part holds: rows [start, stop) of each named variable, in the part's order."""

    name: str
    pieces: tuple[tuple[str, int, int], ...]  # (variable name, start row, stop row)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pieces": [list(p) for p in self.pieces]}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> PartLayout:
        return cls(payload["name"], tuple((str(n), int(a), int(b)) for n, a, b in payload["pieces"]))


def write_part(
    directory: str | Path, values: Sequence[np.ndarray], slots: Sequence[Sequence[np.ndarray]]
) -> None:
    """Write one part's arrays: `values` in the part's order, and per slot (meta's order) the same."""
    tf = _tensorflow()

    Path(directory).mkdir(parents=True, exist_ok=True)
    holder = tf.train.Checkpoint(
        values=[tf.Variable(v) for v in values],
        slots=[[tf.Variable(v) for v in per_slot] for per_slot in slots],
    )
    holder.write(str(Path(directory) / PREFIX))


PartArrays = tuple[list[np.ndarray], list[list[np.ndarray]]]  # values, then per slot the same


def read_part(directory: str | Path, count: int, slot_count: int) -> PartArrays:
    """One part's arrays back, by key: no variables to build first."""
    tf = _tensorflow()

    reader = tf.train.load_checkpoint(str(Path(directory) / PREFIX))
    key = "{}/.ATTRIBUTES/VARIABLE_VALUE".format
    values = [reader.get_tensor(key(f"values/{i}")) for i in range(count)]
    slots = [[reader.get_tensor(key(f"slots/{s}/{i}")) for i in range(count)] for s in range(slot_count)]
    return values, slots


def all_finite(arrays: Sequence[np.ndarray]) -> bool:
    return all(np.isfinite(a).all() for a in arrays if np.asarray(a).dtype.kind == "f")


def _tensorflow():
    """TensorFlow for a checkpoint's files: the process's own where it has one (a shard, a worker),
    else imported without Keras and with every GPU hidden (the driver, a command reading a run)."""
    from towerflow.tf_import import import_tensorflow

    return import_tensorflow(gpus=False, keras=False)


# -- meta ------------------------------------------------------------------------------------------
def checkpoint_meta(
    global_step: int,
    optimizer: str,
    variables: Sequence[tuple[str, Sequence[int], str]],
    slot_names: Sequence[str],
    parts: Sequence[PartLayout],
    model_state: dict[str, np.ndarray] | None = None,
    data_position: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `meta.json` of a checkpoint: what it holds and where, written last."""
    return {
        "format": FORMAT_VERSION,
        "global_step": int(global_step),
        "optimizer": optimizer,
        "variables": [
            {"name": n, "shape": list(shape), "dtype": str(dtype)} for n, shape, dtype in variables
        ],
        "slots": list(slot_names),
        "parts": [part.to_json() for part in parts],
        "model_state": [
            {"name": n, "shape": list(v.shape), "dtype": str(v.dtype)} for n, v in (model_state or {}).items()
        ],
        "data_position": dict(data_position or {}),
        "written_at": time.time(),
    }


def meta_parts(meta: dict[str, Any]) -> list[PartLayout]:
    """The parts a checkpoint's meta lists ([] for a format-1 checkpoint, which has none)."""
    return [PartLayout.from_json(p) for p in meta.get("parts", [])]


def read_meta(directory: str | Path) -> dict:
    return json.loads((Path(directory) / META).read_text())


def write_meta_durably(path: Path, payload: dict) -> None:
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())


# -- whole checkpoints -----------------------------------------------------------------------------
def staging_directory(parent: str | Path, step: int) -> Path:
    """A hidden directory to build `ckpt-<step>` in (never listed: it has no checkpoint's name)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f"{STAGING_PREFIX}{checkpoint_name(step)}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def publish(staging: Path, meta: dict[str, Any]) -> Path:
    """Write `meta.json` into a complete staging directory and rename it into place."""
    final = staging.parent / checkpoint_name(int(meta["global_step"]))
    write_meta_durably(staging / META, meta)
    if final.exists():  # the same step saved twice (e.g. periodic and final): replace it whole,
        # the old one moved aside first: a crash meanwhile leaves no half-deleted checkpoint to resume from
        replaced = final.with_name(f".replaced-{final.name}-{os.getpid()}")
        os.replace(final, replaced)
        os.replace(staging, final)
        shutil.rmtree(replaced, ignore_errors=True)
        return final
    os.replace(staging, final)
    return final


def write_checkpoint(state: TrainingState, parent: str | Path) -> Path:
    """Write a whole `state` as `parent/ckpt-<step>`, one part of whole variables; returns the directory."""
    staging = staging_directory(parent, state.global_step)
    try:
        slot_names = sorted(state.slots)
        write_part(
            staging / shard_part_name(0),
            [state.variables[n] for n in state.names],
            [[state.slots[s][n] for n in state.names] for s in slot_names],
        )
        if state.model_state:
            write_part(staging / MODEL_PART, list(state.model_state.values()), [])
        whole = PartLayout(shard_part_name(0), tuple((n, 0, _rows(state.variables[n])) for n in state.names))
        meta = checkpoint_meta(
            state.global_step,
            state.optimizer,
            [(n, state.variables[n].shape, state.variables[n].dtype) for n in state.names],
            slot_names,
            [whole],
            state.model_state,
            state.data_position,
        )
        return publish(staging, meta)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_checkpoint(directory: str | Path) -> TrainingState:
    """Read a checkpoint directory back into whole variables and slots."""
    directory = Path(directory)
    if not (directory / META).is_file():
        raise FileNotFoundError(f"{directory} is not a complete towerflow checkpoint (no {META})")
    meta = read_meta(directory)
    if int(meta.get("format", 1)) == 1:
        return _read_format_1(directory, meta)
    return state_from_parts(meta, lambda name, count, slots: read_part(directory / name, count, slots))


def state_from_parts(
    meta: dict[str, Any], read_arrays: Callable[[str, int, int], PartArrays]
) -> TrainingState:
    """Join a format-2 checkpoint's parts into whole variables, one part at a time;
    `read_arrays(part name, pieces, slots)` reads one part's arrays as `read_part` does."""
    names = [v["name"] for v in meta["variables"]]
    slot_names = list(meta["slots"])
    chunks: dict[str, list[tuple[int, np.ndarray]]] = {n: [] for n in names}
    slot_chunks: dict[str, dict[str, list[tuple[int, np.ndarray]]]] = {
        s: {n: [] for n in names} for s in slot_names
    }
    for part in meta_parts(meta):
        values, slots = read_arrays(part.name, len(part.pieces), len(slot_names))
        for i, (name, start, _) in enumerate(part.pieces):
            chunks[name].append((start, values[i]))
            for s, slot in enumerate(slot_names):
                slot_chunks[slot][name].append((start, slots[s][i]))
    model_state = {}
    if meta.get("model_state"):
        values, _ = read_arrays(MODEL_PART, len(meta["model_state"]), 0)
        model_state = {v["name"]: value for v, value in zip(meta["model_state"], values)}
    shapes = {v["name"]: tuple(v["shape"]) for v in meta["variables"]}
    return TrainingState(
        global_step=int(meta["global_step"]),
        optimizer=meta["optimizer"],
        names=names,
        variables={n: _join(chunks[n], shapes[n]) for n in names},
        slots={s: {n: _join(slot_chunks[s][n], shapes[n]) for n in names} for s in slot_names},
        data_position=dict(meta.get("data_position") or {}),
        model_state=model_state,
    )


def _rows(value: np.ndarray) -> int:
    return int(value.shape[0]) if value.ndim else 1


def _join(chunks: list[tuple[int, np.ndarray]], shape: tuple[int, ...]) -> np.ndarray:
    if not chunks:
        raise ValueError("a checkpoint part is missing: a variable has no rows in any part")
    ordered = [v for _, v in sorted(chunks, key=lambda c: c[0])]
    joined = np.concatenate(ordered) if len(ordered) > 1 else np.array(ordered[0])
    return joined.reshape(shape)


def _read_format_1(directory: Path, meta: dict[str, Any]) -> TrainingState:
    state = TrainingState(
        global_step=int(meta["global_step"]),
        optimizer=meta["optimizer"],
        names=[v["name"] for v in meta["variables"]],
        variables={v["name"]: np.zeros(v["shape"], v["dtype"]) for v in meta["variables"]},
        slots={
            slot: {v["name"]: np.zeros(v["shape"], v["dtype"]) for v in meta["variables"]}
            for slot in meta["slots"]
        },
        data_position=dict(meta.get("data_position") or {}),
        model_state={v["name"]: np.zeros(v["shape"], v["dtype"]) for v in meta.get("model_state", [])},
    )
    holder = _format_1_object(state)
    holder.read(str(directory / PREFIX)).assert_consumed()
    state.variables = {n: v.numpy() for n, v in holder.variables.items()}
    if state.model_state:
        state.model_state = {n: v.numpy() for n, v in holder.model_state.items()}
    state.slots = {s: {n: v.numpy() for n, v in vs.items()} for s, vs in holder.slots.items()}
    state.global_step = int(holder.step.numpy())
    return state


def _format_1_object(state: TrainingState):
    tf = _tensorflow()

    extra = (
        {"model_state": {n: tf.Variable(v) for n, v in state.model_state.items()}}
        if state.model_state
        else {}
    )
    return tf.train.Checkpoint(
        **extra,
        step=tf.Variable(state.global_step, dtype=tf.int64),
        variables={n: tf.Variable(state.variables[n]) for n in state.names},
        slots={s: {n: tf.Variable(v[n]) for n in state.names} for s, v in state.slots.items()},
        data_position=tf.Variable(json.dumps(state.data_position, sort_keys=True)),
    )
