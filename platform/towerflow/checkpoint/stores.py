"""Where checkpoints live: a local directory, or the MLflow run's artifacts under `checkpoints/`.

Both write a checkpoint locally first (atomically, see files.py). The MLflow store then uploads
the TensorFlow files before `meta.json`, and lists only directories that hold a `meta.json`, so an
upload cut short is never picked by a resume.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from towerflow.checkpoint.files import META, checkpoint_name, read_checkpoint, read_meta, write_checkpoint
from towerflow.checkpoint.state import TrainingState

ARTIFACT_DIR = "checkpoints"


class CheckpointStore(Protocol):
    def save(self, state: TrainingState) -> str: ...
    def list(self) -> list[tuple[int, float]]: ...  # (step, written_at), complete checkpoints only
    def load(self, step: int) -> TrainingState: ...
    def delete(self, step: int) -> None: ...


def latest_step(store: CheckpointStore) -> int | None:
    steps = [step for step, _ in store.list()]
    return max(steps) if steps else None


class LocalCheckpointStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def save(self, state: TrainingState) -> str:
        return str(write_checkpoint(state, self.directory))

    def list(self) -> list[tuple[int, float]]:
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.glob("ckpt-*"):
            if (path / META).is_file():
                meta = read_meta(path)
                found.append((int(meta["global_step"]), float(meta["written_at"])))
        return sorted(found)

    def load(self, step: int) -> TrainingState:
        return read_checkpoint(self.directory / checkpoint_name(step))

    def delete(self, step: int) -> None:
        shutil.rmtree(self.directory / checkpoint_name(step), ignore_errors=True)


class MlflowCheckpointStore:
    """Checkpoints as artifacts of one MLflow run: `checkpoints/ckpt-<step>/`."""

    def __init__(self, client, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self._written_at_by_path: dict[str, float] = {}  # a checkpoint never changes once complete

    def save(self, state: TrainingState) -> str:
        with tempfile.TemporaryDirectory(prefix="towerflow-ckpt-") as scratch:
            local = write_checkpoint(state, scratch)
            target = f"{ARTIFACT_DIR}/{local.name}"
            self._written_at_by_path.pop(target, None)
            for path in sorted(local.iterdir()):
                if path.name != META:
                    self.client.log_artifact(self.run_id, str(path), target)
            self.client.log_artifact(self.run_id, str(local / META), target)  # last: marks it complete
        return target

    def list(self) -> list[tuple[int, float]]:
        found = []
        for entry in self.client.list_artifacts(self.run_id, ARTIFACT_DIR):
            if not entry.is_dir:
                continue
            names = {Path(f.path).name for f in self.client.list_artifacts(self.run_id, entry.path)}
            if META in names:
                step = int(Path(entry.path).name.split("-", 1)[1])
                found.append((step, self._written_at(entry.path)))
        return sorted(found)

    def load(self, step: int) -> TrainingState:
        with tempfile.TemporaryDirectory(prefix="towerflow-ckpt-") as scratch:
            local = self.client.download_artifacts(
                self.run_id, f"{ARTIFACT_DIR}/{checkpoint_name(step)}", scratch
            )
            return read_checkpoint(local)

    def delete(self, step: int) -> None:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        run = self.client.get_run(self.run_id)
        repository = get_artifact_repository(run.info.artifact_uri)
        path = f"{ARTIFACT_DIR}/{checkpoint_name(step)}"
        repository.delete_artifacts(path)
        self._written_at_by_path.pop(path, None)

    def _written_at(self, path: str) -> float:
        if path not in self._written_at_by_path:
            self._written_at_by_path[path] = self._download_written_at(path)
        return self._written_at_by_path[path]

    def _download_written_at(self, path: str) -> float:
        with tempfile.TemporaryDirectory(prefix="towerflow-ckpt-") as scratch:
            local = self.client.download_artifacts(self.run_id, f"{path}/{META}", scratch)
            return float(read_meta(Path(local).parent)["written_at"])
