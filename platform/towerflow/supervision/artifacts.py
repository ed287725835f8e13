"""Where hooks put files: the MLflow run's artifacts, or a local directory when nothing is tracked."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol


class ArtifactSink(Protocol):
    def log_dir(self, local_dir: str | Path, artifact_path: str) -> str: ...


class MlflowArtifactSink:
    def __init__(self, client, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log_dir(self, local_dir: str | Path, artifact_path: str) -> str:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)
        return f"runs:/{self.run_id}/{artifact_path}"


class LocalArtifactSink:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def log_dir(self, local_dir: str | Path, artifact_path: str) -> str:
        target = self.root / artifact_path
        shutil.copytree(local_dir, target, dirs_exist_ok=True)
        return str(target)
