"""A data pipeline's claim on the cluster's cores, withdrawn when the pipeline ends or its driver dies.

Ray Data's autoscaling coordinator (a detached actor) splits every node's cores evenly, rounded down,
between the executions it knows; an execution's shutdown withdraws its claim, and one that stops
speaking is forgotten only 180 s later (`RAY_DATA_AUTOSCALING_REQUEST_EXPIRE_TIME_S`). A killed
driver takes its split coordinator, and so the execution, with it before that shutdown: the job
started next (a `--resume auto`) would read with half the cores, or none on a 2-CPU node, for
three minutes.

So each split coordinator is a named actor and records the execution it runs under its name in
Ray's GCS key-value store, which outlives drivers. Before a new pipeline starts, the claims of
coordinators no longer alive are withdrawn. This leans on Ray Data's internals (pinned with Ray
in pyproject); a change there leaves the claims to expire as before, logged at debug level.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import ray

logger = logging.getLogger(__name__)

ACTOR_NAMESPACE = "towerflow-data"  # the split coordinators' names live here
_KV_NAMESPACE = "towerflow"
_KV_PREFIX = "data-claim/"


def new_coordinator_name() -> str:
    return f"split-coordinator-{uuid.uuid4().hex}"


def requester_of(executor) -> str:
    """The name Ray Data's execution claims cores under (its cluster autoscaler's requester id)."""
    return f"data-{executor._dataset_id}"


def record(coordinator_name: str, requester: str) -> None:
    """The coordinator `coordinator_name` now runs the execution that claims as `requester`."""
    from ray.experimental.internal_kv import _internal_kv_put

    try:
        _internal_kv_put(_KV_PREFIX + coordinator_name, requester, overwrite=True, namespace=_KV_NAMESPACE)
    except Exception:  # the claim then expires as Ray Data's would
        logger.debug("could not record the data pipeline's claim", exc_info=True)


def forget(coordinator_name: str) -> None:
    """The coordinator's execution has ended and withdrawn its claim itself."""
    from ray.experimental.internal_kv import _internal_kv_del

    try:
        _internal_kv_del(_KV_PREFIX + coordinator_name, namespace=_KV_NAMESPACE)
    except Exception:
        logger.debug("could not forget the data pipeline's claim", exc_info=True)


def recorded() -> dict[str, str]:
    """Coordinator name -> the requester its execution claims as, for every claim on record."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    found = {}
    for key in _internal_kv_list(_KV_PREFIX, namespace=_KV_NAMESPACE):
        value = _internal_kv_get(key, namespace=_KV_NAMESPACE)
        if value is not None:
            found[key.decode()[len(_KV_PREFIX) :]] = value.decode()
    return found


def _alive(coordinator_name: str) -> bool:
    try:
        ray.get_actor(coordinator_name, namespace=ACTOR_NAMESPACE)
    except ValueError:  # no live actor of that name: it died with its driver, or ended
        return False
    return True


def withdraw_orphaned() -> list[str]:
    """Withdraw the claims of executions whose split coordinator is gone; returns their requesters."""
    try:
        orphans = {name: who for name, who in recorded().items() if not _alive(name)}
        if not orphans:
            return []
        from ray.data._internal.cluster_autoscaler import get_or_create_autoscaling_coordinator

        autoscaling = get_or_create_autoscaling_coordinator()
        for name, requester in orphans.items():
            autoscaling.cancel_request.remote(requester)
            forget(name)
        wait_for_withdrawal(autoscaling)
    except Exception:  # Ray Data's internals moved: the claims expire as before
        logger.debug("could not withdraw the claims of data pipelines whose driver is gone", exc_info=True)
        return []
    logger.info(
        "withdrew %d data pipeline claim(s) on the cluster's cores left by a driver that is gone: %s",
        len(orphans),
        ", ".join(sorted(orphans.values())),
    )
    return sorted(orphans.values())


def wait_for_withdrawal(autoscaling: Any = None) -> None:
    """Wait until the autoscaling coordinator (`autoscaling`, a handle already got, or looked up)
    has every withdrawal sent to it from this process (sent without waiting; a later call to the
    same actor from here runs after them)."""
    from ray.data._internal.cluster_autoscaler import get_or_create_autoscaling_coordinator

    try:
        autoscaling = autoscaling or get_or_create_autoscaling_coordinator()
        ray.get(autoscaling.get_reserved_resources.remote(""), timeout=10)
    except Exception:  # Ray Data's internals moved, or the actor is gone: the claim then expires
        logger.debug("could not confirm the end of the data's claim on the cluster's cores", exc_info=True)
