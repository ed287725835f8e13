"""`--resume auto`: continue the newest unfinished run of the same job, or start a new one.

What a retried job needs (a RayJob's backoffLimit, a second `ray job submit` of the same command,
a driver restarted after its node was lost): the same command either goes on with the run its
predecessor left (RUNNING because its driver died, FAILED or KILLED) from that run's latest
checkpoint, or, when the newest run of the job finished or none exists, starts a new one. It
assumes no other driver of the job is still running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

UNFINISHED = ("RUNNING", "FAILED", "KILLED")
LOOKED_AT = 100  # the newest runs of the job looked through for one that is not a comparison's
ORPHAN_NOTE = "--resume auto: its driver was lost before its first checkpoint; a new run started over"


def resumable_run(
    spec: Any, tracking_uri: str, has_live_shards: Callable[[str], bool] = lambda run_id: False
) -> str | None:
    """The id of the newest run of `spec`'s job when it is unfinished and has a checkpoint, or is
    RUNNING with live shards on this cluster (`has_live_shards`: its driver was lost before its
    first checkpoint, runtime/run_keeper.py); else None. A store that cannot be read (a server
    away, credentials refused) is a ClusterError that says so."""
    import requests
    from mlflow.exceptions import MlflowException

    from towerflow.tracking.store import store_unreadable

    try:
        return _newest_unfinished(spec, tracking_uri, has_live_shards)
    except (MlflowException, requests.RequestException) as exc:
        raise store_unreadable(exc, tracking_uri, f"--resume auto (job {spec.name})") from exc


def _newest_unfinished(spec: Any, tracking_uri: str, has_live_shards: Callable[[str], bool]) -> str | None:
    from mlflow.tracking import MlflowClient

    from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
    from towerflow.checkpoint.stores import latest_step

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(spec.experiment)
    if experiment is None:
        log.info("--resume auto: no run of job %s yet: starting one", spec.name)
        return None
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`towerflow.job` = '{spec.name}'",
        order_by=["attributes.start_time DESC"],
        max_results=LOOKED_AT,
    )
    # `towerflow compare`'s runs (a parent and its child per mode) are the job's too, but not the
    # run a plain command goes on with (a child is of another mode, perhaps, and under its parent).
    run = next((run for run in runs if not _of_a_comparison(run)), None)
    if run is None:
        log.info("--resume auto: no run of job %s yet: starting one", spec.name)
        return None
    run_id, status = run.info.run_id, run.info.status
    if status not in UNFINISHED:
        log.info(
            "--resume auto: the newest run of job %s (%s) is %s: starting a new one",
            spec.name,
            run_id,
            status,
        )
        return None
    step = latest_step(MlflowCheckpointStore(client, run_id))
    if step is None and status == "RUNNING" and has_live_shards(run_id):
        log.info("--resume auto: continuing run %s (%s) from its live shards", run_id, status)
        return run_id
    if step is None:
        log.info("--resume auto: run %s (%s) left no checkpoint: starting a new run", run_id, status)
        if status == "RUNNING":  # its driver died before the first checkpoint: nobody will end it
            client.set_tag(run_id, "towerflow.ended_by", ORPHAN_NOTE)
            client.set_terminated(run_id, "FAILED")
        return None
    # From its live shards where they are still there (said next), else from this checkpoint.
    log.info("--resume auto: continuing run %s (%s; its newest checkpoint: step %d)", run_id, status, step)
    return run_id


def _of_a_comparison(run: Any) -> bool:
    tags = run.data.tags
    return tags.get("mode") == "compare" or "mlflow.parentRunId" in tags
