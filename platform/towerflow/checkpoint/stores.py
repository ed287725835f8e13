"""Where checkpoints live: a local directory, or the MLflow run's artifacts under `checkpoints/`
(mlflow_store.py).

A checkpoint is written in parts (files.py): `store.writer(step)` gives a small picklable writer
that each parameter-server shard uses to write its own part from its own node, and that the driver
commits by writing `meta.json` last. The driver never holds a whole checkpoint. A local store
builds the checkpoint in a hidden directory and renames it into place; the MLflow store uploads
every part before `meta.json` and lists only directories that hold one, so a write cut short is
never picked by a resume. `store.open(step)` reads `meta.json` only; the parts are read where they
are needed (on the shards, for a resume).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from towerflow.checkpoint.files import (
    META,
    MODEL_PART,
    STAGING_PREFIX,
    PartArrays,
    PartLayout,
    checkpoint_name,
    checkpoint_step,
    meta_parts,
    publish,
    read_checkpoint,
    read_meta,
    read_part,
    staging_directory,
    state_from_parts,
    write_checkpoint,
)
from towerflow.checkpoint.state import TrainingState
from towerflow.errors import TrainingError

ARTIFACT_DIR = "checkpoints"


class StoreUnavailable(TrainingError):
    """The checkpoint store did not take a write because it is away or busy (a tracking server that
    does not answer): a later checkpoint may well be written."""


class CheckpointWriter(Protocol):
    """One checkpoint being written, from any process: parts first, then `commit`."""

    step: int

    def reachable(self) -> bool: ...  # can this process write parts itself?
    def write_part(self, name: str, local_directory: str) -> None: ...
    def commit(self, meta: dict[str, Any]) -> None: ...
    def abort(self) -> None: ...


class PartReader(Protocol):
    """One complete checkpoint's parts, read from any process."""

    def reachable(self) -> bool: ...
    @contextlib.contextmanager
    def local_part(self, name: str) -> Iterator[Path]: ...  # the part's files in a local directory


class CheckpointStore(Protocol):
    def save(self, state: TrainingState) -> str: ...  # a whole state, in one part
    def writer(self, step: int) -> CheckpointWriter: ...
    def list(self) -> list[tuple[int, float]]: ...  # (step, written_at), complete checkpoints only
    def open(self, step: int) -> StoredCheckpoint: ...
    def load(self, step: int) -> TrainingState: ...
    def delete(self, step: int) -> None: ...
    # Remove the checkpoints of steps before `before` that were begun and never committed (a write
    # cut short by an outage or a killed driver); returns their steps.
    def prune_unfinished(self, before: int) -> list[int]: ...


def latest_step(store: CheckpointStore) -> int | None:
    steps = [step for step, _ in store.list()]
    return max(steps) if steps else None


@dataclass
class StoredCheckpoint:
    """A complete checkpoint in a store, opened by its `meta.json` alone. It answers what a resume
    needs first (step, data position, model state) as a whole TrainingState would; its variables are
    read part by part, where they are needed."""

    meta: dict[str, Any]
    reader: PartReader
    _model_state: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def global_step(self) -> int:
        return int(self.meta["global_step"])

    @property
    def optimizer(self) -> str:
        return str(self.meta["optimizer"])

    @property
    def data_position(self) -> dict[str, Any]:
        return dict(self.meta.get("data_position") or {})

    @property
    def examples_seen(self) -> int:
        return int(self.data_position.get("examples_seen") or 0)

    @property
    def slot_names(self) -> list[str]:
        return list(self.meta.get("slots") or [])

    @property
    def parts(self) -> list[PartLayout]:
        """Its parts ([] for a format-1 checkpoint, which is read whole)."""
        return meta_parts(self.meta)

    @property
    def model_state(self) -> dict[str, np.ndarray]:
        if self._model_state is None:
            listed = self.meta.get("model_state") or []
            self._model_state = {}
            if listed and self.parts:
                values, _ = self._read_arrays(MODEL_PART, len(listed), 0)
                self._model_state = {v["name"]: value for v, value in zip(listed, values)}
            elif listed:
                self._model_state = self.read().model_state
        return self._model_state

    def read_part(self, name: str, with_slots: bool = True) -> PartArrays:
        """One part's values and (per slot, in `slot_names` order) slots."""
        part = next((p for p in self.parts if p.name == name), None)
        if part is None:
            raise KeyError(f"checkpoint of step {self.global_step} has no part {name!r}")
        return self._read_arrays(name, len(part.pieces), len(self.slot_names) if with_slots else 0)

    def read(self) -> TrainingState:
        """The whole state, joined part by part."""
        if self.parts:
            return state_from_parts(self.meta, self._read_arrays)
        with self.reader.local_part("") as directory:  # format 1: one file set of whole variables
            return read_checkpoint(directory)

    def _read_arrays(self, name: str, count: int, slot_count: int) -> PartArrays:
        with self.reader.local_part(name) as directory:
            return read_part(directory, count, slot_count)


# -- a local directory -----------------------------------------------------------------------------
@functools.cache
def host_name() -> str:
    return socket.gethostname()


@dataclass
class LocalCheckpointWriter:
    """Parts go straight into a hidden staging directory; `commit` renames it into place. A process on
    another machine cannot reach that directory (no shared disk): `reachable` says so."""

    directory: str
    step: int
    staging: str
    host: str

    def reachable(self) -> bool:
        return host_name() == self.host and Path(self.staging).is_dir()

    def write_part(self, name: str, local_directory: str) -> None:
        target = Path(self.staging) / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(local_directory, target)

    def commit(self, meta: dict[str, Any]) -> None:
        publish(Path(self.staging), meta)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


@dataclass
class LocalPartReader:
    checkpoint: str  # the ckpt-<step> directory
    host: str

    def reachable(self) -> bool:
        return host_name() == self.host and (Path(self.checkpoint) / META).is_file()

    @contextlib.contextmanager
    def local_part(self, name: str) -> Iterator[Path]:
        yield Path(self.checkpoint) / name


class LocalCheckpointStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def save(self, state: TrainingState) -> str:
        return str(write_checkpoint(state, self.directory))

    def writer(self, step: int) -> LocalCheckpointWriter:
        staging = staging_directory(self.directory, step)
        return LocalCheckpointWriter(str(self.directory.resolve()), step, str(staging.resolve()), host_name())

    def list(self) -> list[tuple[int, float]]:
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.glob("ckpt-*"):
            if (path / META).is_file():
                meta = read_meta(path)
                found.append((int(meta["global_step"]), float(meta["written_at"])))
        return sorted(found)

    def open(self, step: int) -> StoredCheckpoint:
        path = (self.directory / checkpoint_name(step)).resolve()
        if not (path / META).is_file():
            raise FileNotFoundError(f"{path} is not a complete towerflow checkpoint (no {META})")
        return StoredCheckpoint(read_meta(path), LocalPartReader(str(path), host_name()))

    def load(self, step: int) -> TrainingState:
        return read_checkpoint(self.directory / checkpoint_name(step))

    def delete(self, step: int) -> None:
        shutil.rmtree(self.directory / checkpoint_name(step), ignore_errors=True)

    def prune_unfinished(self, before: int) -> list[int]:
        """Staging directories of earlier steps: their writers were killed (a commit renames its
        staging directory away)."""
        pruned = []
        for path in self.directory.glob(f"{STAGING_PREFIX}*"):  # none where the directory is not
            step = checkpoint_step(path.name)
            if step is not None and step < before:
                shutil.rmtree(path, ignore_errors=True)
                pruned.append(step)
        return sorted(pruned)
