"""One checkpoint on disk: a `tf.train.Checkpoint` plus `meta.json`, written atomically.

A checkpoint is a directory `ckpt-<step>`. It is built under a hidden temporary name and renamed
into place only when complete, and `meta.json` (what a reader looks for first) is its last file, so
a crash mid-write never leaves a directory that restore would pick and then fail on.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from towerflow.checkpoint.state import TrainingState

META = "meta.json"
PREFIX = "state"  # tf.train.Checkpoint file prefix inside the directory
FORMAT_VERSION = 1


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}"


def write_checkpoint(state: TrainingState, parent: str | Path) -> Path:
    """Write `state` as `parent/ckpt-<step>`; returns the directory."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / checkpoint_name(state.global_step)
    staging = parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _checkpoint_object(state).write(str(staging / PREFIX))
        meta = {
            "format": FORMAT_VERSION,
            "global_step": state.global_step,
            "optimizer": state.optimizer,
            "variables": [
                {"name": n, "shape": list(state.variables[n].shape), "dtype": str(state.variables[n].dtype)}
                for n in state.names
            ],
            "slots": sorted(state.slots),
            "model_state": [
                {"name": n, "shape": list(v.shape), "dtype": str(v.dtype)}
                for n, v in state.model_state.items()
            ],
            "data_position": state.data_position,
            "written_at": time.time(),
        }
        _write_json_durably(staging / META, meta)
        if final.exists():  # the same step saved twice (e.g. periodic and final): replace it whole
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def read_meta(directory: str | Path) -> dict:
    return json.loads((Path(directory) / META).read_text())


def read_checkpoint(directory: str | Path) -> TrainingState:
    """Read a checkpoint directory back into whole variables and slots."""
    directory = Path(directory)
    if not (directory / META).is_file():
        raise FileNotFoundError(f"{directory} is not a complete towerflow checkpoint (no {META})")
    meta = read_meta(directory)
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
    holder = _checkpoint_object(state)
    holder.read(str(directory / PREFIX)).assert_consumed()
    state.variables = {n: v.numpy() for n, v in holder.variables.items()}
    if state.model_state:
        state.model_state = {n: v.numpy() for n, v in holder.model_state.items()}
    state.slots = {s: {n: v.numpy() for n, v in vs.items()} for s, vs in holder.slots.items()}
    state.global_step = int(holder.step.numpy())
    return state


def _checkpoint_object(state: TrainingState):
    import tensorflow as tf

    # Model state only when there is some: checkpoints of models without any keep their old layout.
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


def _write_json_durably(path: Path, payload: dict) -> None:
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
