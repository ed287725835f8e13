"""Where runs are stored: the spec's URI, else MLFLOW_TRACKING_URI, else a SQLite store right here.

The embedded default is the same store that `mlflow ui` started in the working directory shows.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DB = "mlflow.db"


def default_tracking_uri(spec_uri: str | None = None, workdir: str | Path | None = None) -> str:
    if spec_uri:
        return spec_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    base = Path(workdir or os.getcwd()).resolve()
    return f"sqlite:///{base / DEFAULT_DB}"


def artifact_location_for(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a SQLite store live beside its database (`mlartifacts/<experiment>`), not in
    whatever directory a run happened to start in; other stores keep their own default."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///"))
    return (database.parent / "mlartifacts" / experiment).resolve().as_uri()
