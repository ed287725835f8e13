"""Where runs are stored: the spec's URI, else MLFLOW_TRACKING_URI, else a SQLite store right here.

The embedded default is the same store that `mlflow ui` started in the working directory shows.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_DB = "mlflow.db"
# Set by Ray for the entrypoint of a job (`ray job submit`): the job runs in a working directory of
# Ray's, which Ray deletes once no job uses it.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def default_tracking_uri(spec_uri: str | None = None, workdir: str | Path | None = None) -> str:
    if spec_uri:
        return spec_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    base = Path(workdir or os.getcwd()).resolve()
    return f"sqlite:///{base / DEFAULT_DB}"


def run_store_uri(spec_uri: str | None = None) -> str:
    """The store a new run goes to (default_tracking_uri()). Where that store would be lost with a
    Ray job's working directory, says so on stderr, once per process."""
    if warning := job_store_warning(spec_uri):
        _warn_once(warning)
    return default_tracking_uri(spec_uri)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


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


def job_store_warning(spec_uri: str | None = None) -> str | None:
    """A warning when a Ray job would keep its runs in the default store, inside Ray's temporary
    working directory of the job (where no one would find them, and which Ray deletes); else None."""
    if spec_uri or os.environ.get("MLFLOW_TRACKING_URI") or not _in_job_working_dir():
        return None
    return (
        f"this Ray job would keep its MLflow runs in {default_tracking_uri()}, inside the job's "
        "temporary working directory, which Ray deletes: point MLFLOW_TRACKING_URI at a tracking "
        "server or shared store (ray job submit --runtime-env-json "
        '\'{"env_vars": {"MLFLOW_TRACKING_URI": "..."}}\'), or set tracking.tracking_uri'
    )


def _in_job_working_dir() -> bool:
    """Whether this is a Ray job's entrypoint running in the working directory Ray unpacked for it."""
    try:
        config = json.loads(os.environ.get(RAY_JOB_ENV) or "{}")
    except ValueError:
        return False
    return bool((config.get("runtime_env") or {}).get("working_dir"))


# What a server that answers says when it cannot serve now (MLflow's error codes); any other answer
# is a refusal. No answer at all (refused connection, timeout, MLflow's retries used up) is an outage.
TRANSIENT_CODES = frozenset(
    {
        "INTERNAL_ERROR",
        "TEMPORARILY_UNAVAILABLE",
        "SERVICE_UNDER_MAINTENANCE",
        "DEADLINE_EXCEEDED",
        "REQUEST_LIMIT_EXCEEDED",
        "RESOURCE_EXHAUSTED",
        "ABORTED",
        "COULD_NOT_ACQUIRE_LOCK",
    }
)


def server_unavailable(exc: BaseException) -> bool:
    """Whether a failed write means the tracking server is away or busy (worth trying again), not
    that it refused the write: an API error by its code, an artifact upload's by its HTTP status."""
    import requests
    from mlflow.exceptions import RestException

    if isinstance(exc, RestException):
        return exc.error_code in TRANSIENT_CODES
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return True
