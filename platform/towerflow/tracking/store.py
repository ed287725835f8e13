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


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite store (`<its folder>/mlruns`), so a
    store and its artifacts move together; None (the server's default) for any other store."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return (Path(tracking_uri[len(prefix) :]).resolve().parent / "mlruns").as_uri()


def ensure_experiment(client, name: str, tracking_uri: str) -> str:
    """The id of experiment `name`, created (with artifact_location()) when missing."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location(tracking_uri))
