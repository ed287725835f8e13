"""Checkpoints in an MLflow run's artifacts, under `checkpoints/` (see stores.py for the layout and
the write protocol): each shard uploads its own part from its own node, through the tracking server
where it proxies artifacts; `meta.json` last marks a checkpoint complete.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from towerflow.checkpoint.files import (
    META,
    checkpoint_name,
    checkpoint_step,
    read_meta,
    write_checkpoint,
    write_meta_durably,
)
from towerflow.checkpoint.state import TrainingState
from towerflow.checkpoint.stores import ARTIFACT_DIR, StoredCheckpoint, StoreUnavailable, host_name


@contextlib.contextmanager
def _unavailable_as_such(tracking_uri: str, what: str, *, local: bool = False) -> Iterator[None]:
    """A server that is away or busy raises StoreUnavailable (`what`, then the server's address and
    error); its refusals, and every error of a local store, stay what they are."""
    from towerflow.tracking.store import server_unavailable, shown_address, without_credentials

    try:
        yield
    except Exception as exc:
        if local or not server_unavailable(exc):
            raise
        said = without_credentials(str(exc).strip())[:500]
        raise StoreUnavailable(f"{what} {shown_address(tracking_uri)}: {said}") from exc


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
        return _local_artifact_path(self.artifact_uri) is None or host_name() == self.host

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

    def _unavailable_as_such(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Local artifacts are never away: their errors stay what they are."""
        return _unavailable_as_such(
            self.tracking_uri,
            f"checkpoint of step {self.step}: {what} was not written to run {self.run_id}'s artifacts at",
            local=_local_artifact_path(self.artifact_uri) is not None,
        )

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
        return _local_artifact_path(self.artifact_uri) is None or host_name() == self.host

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
        tracking_uri = self.client.tracking_uri
        what = f"checkpoint of step {step}: run {self.run_id}'s artifact location was not read from"
        with _unavailable_as_such(tracking_uri, what):
            artifact_uri = self.artifact_uri  # asked of the server at the first checkpoint
        return MlflowCheckpointWriter(tracking_uri, self.run_id, step, artifact_uri, host_name())

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
        reader = MlflowPartReader(self.client.tracking_uri, self.run_id, path, self.artifact_uri, host_name())
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
