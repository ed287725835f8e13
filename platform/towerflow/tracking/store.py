"""Where runs are stored: the spec's URI, else MLFLOW_TRACKING_URI, else a SQLite store right here.

The embedded default is the same store that `mlflow ui` started in the working directory shows.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import urllib.parse
from pathlib import Path

from towerflow.errors import ClusterError, SpecError

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
    that it refused the write: an MLflow error by its code (a server's answer, or a local store's
    own refusal: a deleted run's INVALID_PARAMETER_VALUE is no outage), an artifact upload's by its HTTP
    status. MLflow's "no answer" errors carry INTERNAL_ERROR, a transient code."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        return exc.error_code in TRANSIENT_CODES
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return True


_CREDENTIALS = re.compile(r"//[^/@\s]+@")


def shown_address(url: str) -> str:
    """`url` fit to print: without any user:password it holds, query or fragment."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(
        parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="")
    ).rstrip("/")


def without_credentials(text: str) -> str:
    """`text` with the user:password of any address in it taken out (`postgresql://u:secret@db`,
    `https://u:secret@host`): what goes into a run's tags and the logs."""
    return _CREDENTIALS.sub("//", text)


def run_unreadable(exc: BaseException, uri: str, what: str) -> ClusterError | SpecError:
    """The error for a run that could not be read from the store at `uri`, `what` naming the run:
    no such run (SpecError), or a store that did not answer or refused (ClusterError), which is no
    reason to say the run does not exist."""
    if getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
        return SpecError(f"{what}: no such run in the MLflow store {shown_address(uri)}")
    return store_unreadable(exc, uri, what)


def store_unreadable(exc: BaseException, uri: str, what: str) -> ClusterError:
    """The error for a store that could not be read (away, refusing these credentials, broken)."""
    detail = without_credentials(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return ClusterError(
        f"{what}: the MLflow store {shown_address(uri)} could not be read ({detail[:500]}): check that "
        "the tracking server is up and reachable from here, and MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD where it asks for them"
    )
