"""Where checkpoints live: a local directory, or the MLflow run's artifacts under `checkpoints/`.

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
import tempfile
import urllib.parse
import urllib.request
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
    write_meta_durably,
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
def _host() -> str:
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
        return _host() == self.host and Path(self.staging).is_dir()

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
        return _host() == self.host and (Path(self.checkpoint) / META).is_file()

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
        return LocalCheckpointWriter(str(self.directory.resolve()), step, str(staging.resolve()), _host())

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
        return StoredCheckpoint(read_meta(path), LocalPartReader(str(path), _host()))

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


# -- an MLflow run's artifacts ---------------------------------------------------------------------
def _local_artifact_path(artifact_uri: str) -> Path | None:
    """The directory of a run's artifacts where they are a local path; None for a server or bucket."""
    if artifact_uri.startswith("/"):
        return Path(artifact_uri)
    parsed = urllib.parse.urlparse(artifact_uri)
    return Path(urllib.request.url2pathname(parsed.path)) if parsed.scheme == "file" else None


@dataclass
class MlflowCheckpointWriter:
    """Parts go to `checkpoints/ckpt-<step>/<part>/` of the run's artifacts from whichever node makes
    them: through the tracking server where it proxies artifacts (the process needs the server's
    credentials in its environment, as any MLflow client), straight into the directory where the
    artifacts are a local path. `meta.json` last marks the checkpoint complete."""

    tracking_uri: str
    run_id: str
    step: int
    artifact_uri: str
    host: str

    @property
    def path(self) -> str:
        return f"{ARTIFACT_DIR}/{checkpoint_name(self.step)}"

    def reachable(self) -> bool:
        return _local_artifact_path(self.artifact_uri) is None or _host() == self.host

    def write_part(self, name: str, local_directory: str) -> None:
        local = _local_artifact_path(self.artifact_uri)
        if local is not None:  # what MLflow's local artifact repository does, without importing MLflow
            target = local / self.path / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(local_directory, target)
        else:
            with self._unavailable_as_such(f"part {name}"):
                self._repository().log_artifacts(local_directory, f"{self.path}/{name}")

    def commit(self, meta: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="towerflow-ckpt-") as scratch:
            write_meta_durably(Path(scratch) / META, meta)
            with self._unavailable_as_such(META):
                self._repository().log_artifact(str(Path(scratch) / META), self.path)

    @contextlib.contextmanager
    def _unavailable_as_such(self, what: str) -> Iterator[None]:
        """A server that is away or busy raises StoreUnavailable; its refusals stay what they are."""
        from towerflow.tracking.store import server_unavailable

        try:
            yield
        except Exception as exc:
            if _local_artifact_path(self.artifact_uri) is not None or not server_unavailable(exc):
                raise
            raise StoreUnavailable(
                f"checkpoint of step {self.step}: {what} was not written to run {self.run_id}'s "
                f"artifacts at {self.tracking_uri}: {str(exc).strip()[:500]}"
            ) from exc

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # nothing uploaded yet is fine
            self._repository().delete_artifacts(self.path)

    def _repository(self):
        return _repository(self.tracking_uri, self.artifact_uri)


@dataclass
class MlflowPartReader:
    tracking_uri: str
    run_id: str
    path: str  # checkpoints/ckpt-<step>
    artifact_uri: str
    host: str

    def reachable(self) -> bool:
        return _local_artifact_path(self.artifact_uri) is None or _host() == self.host

    @contextlib.contextmanager
    def local_part(self, name: str) -> Iterator[Path]:
        local = _local_artifact_path(self.artifact_uri)
        if local is not None:
            yield local / self.path / name if name else local / self.path
            return
        artifact = f"{self.path}/{name}" if name else self.path
        with tempfile.TemporaryDirectory(prefix="towerflow-ckpt-") as scratch:
            yield Path(
                _repository(self.tracking_uri, self.artifact_uri).download_artifacts(artifact, scratch)
            )


class MlflowCheckpointStore:
    """Checkpoints as artifacts of one MLflow run: `checkpoints/ckpt-<step>/`."""

    def __init__(self, client, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self._meta_by_path: dict[str, dict[str, Any]] = {}  # a checkpoint never changes once complete
        self._artifact_uri: str | None = None

    def save(self, state: TrainingState) -> str:
        with tempfile.TemporaryDirectory(prefix="towerflow-ckpt-") as scratch:
            local = write_checkpoint(state, scratch)
            writer = self.writer(state.global_step)
            for path in sorted(local.iterdir()):
                if path.name != META:
                    writer.write_part(path.name, str(path))
            writer.commit(read_meta(local))
        return writer.path

    def writer(self, step: int) -> MlflowCheckpointWriter:
        self._meta_by_path.pop(f"{ARTIFACT_DIR}/{checkpoint_name(step)}", None)
        return MlflowCheckpointWriter(self.client.tracking_uri, self.run_id, step, self.artifact_uri, _host())

    @property
    def artifact_uri(self) -> str:
        if self._artifact_uri is None:
            self._artifact_uri = self.client.get_run(self.run_id).info.artifact_uri
        return self._artifact_uri

    @property
    def repository(self):
        """The run's artifact repository, called directly: through the client, each call would
        look the run up again first (a request more per listing, each checked by the server)."""
        return _repository(self.client.tracking_uri, self.artifact_uri)

    def list(self) -> list[tuple[int, float]]:
        return sorted(
            (step, float(self._meta(path)["written_at"]))
            for step, path, complete in self._checkpoint_dirs()
            if complete
        )

    def prune_unfinished(self, before: int) -> list[int]:
        """Checkpoint directories of earlier steps without a `meta.json`: parts uploaded before the
        server went away, or before their driver was killed."""
        pruned = []
        for step, path, complete in self._checkpoint_dirs():
            if not complete and step < before:
                self.repository.delete_artifacts(path)
                pruned.append(step)
        return sorted(pruned)

    def _checkpoint_dirs(self) -> Iterator[tuple[int, str, bool]]:
        """(step, artifact path, whether it holds a `meta.json`) of each `ckpt-<step>` directory."""
        repository = self.repository
        for entry in repository.list_artifacts(ARTIFACT_DIR):
            step = checkpoint_step(Path(entry.path).name)
            if entry.is_dir and step is not None:
                names = {Path(f.path).name for f in repository.list_artifacts(entry.path)}
                yield step, entry.path, META in names

    def open(self, step: int) -> StoredCheckpoint:
        path = f"{ARTIFACT_DIR}/{checkpoint_name(step)}"
        reader = MlflowPartReader(self.client.tracking_uri, self.run_id, path, self.artifact_uri, _host())
        return StoredCheckpoint(self._meta(path), reader)

    def load(self, step: int) -> TrainingState:
        return self.open(step).read()

    def delete(self, step: int) -> None:
        path = f"{ARTIFACT_DIR}/{checkpoint_name(step)}"
        self.repository.delete_artifacts(path)
        self._meta_by_path.pop(path, None)

    def _meta(self, path: str) -> dict[str, Any]:
        """A complete checkpoint's meta.json, downloaded once (listing and opening both need it)."""
        if path not in self._meta_by_path:
            with tempfile.TemporaryDirectory(prefix="towerflow-ckpt-") as scratch:
                local = self.repository.download_artifacts(f"{path}/{META}", scratch)
                self._meta_by_path[path] = read_meta(Path(local).parent)
        return self._meta_by_path[path]


def _repository(tracking_uri: str, artifact_uri: str):
    """The artifact repository of a run's `artifact_uri`, resolved against `tracking_uri` (a
    server's `mlflow-artifacts:` URI names no host)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    return get_artifact_repository(artifact_uri, tracking_uri=tracking_uri)
