"""A tracked run's shards outlive a lost driver (`training.failure.driver_grace_s`), so that a
driver resuming the run takes them over instead of starting again from the stored checkpoint.

The shards and the run's placement groups are detached from the driver that made them; the run's
control point (run_control.py), detached too, holds what a new driver needs to take them over (a
`Handover`) and ends them once the run has had no driver for the grace period. The workers are not
kept: they end with their driver (their batches come from its data pipeline, which ends with it),
and a new driver starts its own. A new driver goes on from the shards' version and from the data
position the gradients they took tell; no step is redone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from towerflow.errors import ClusterError
from towerflow.runtime.actors import ACTOR_GONE, first_line
from towerflow.runtime.run_control import LEASE_FRESH_S, find_control

log = logging.getLogger(__name__)


@dataclass
class Handover:
    """What a driver needs to take a run's live shards over: told to the control point by the driver
    that has them (again whenever they change), read by the next."""

    placement: Any  # the run's ActorPlacement, with its placement groups
    shards: list[Any]  # the shard actors, by index
    shard_bundles: list[int]  # per shard, its bundle
    spares: list[Any] = field(default_factory=list)  # the spare shards: they end, new ones start
    compatible: dict[str, Any] = field(default_factory=dict)  # what a taker's spec must match


@dataclass
class LiveShards:
    """Where a run goes on from when its new driver took its live shards over: their version and
    the data position the gradients they took tell, with the stored checkpoint it would otherwise
    have gone on from (a later rollback's fallback, and the non-trainable model state: the workers
    that held a newer one ended with their driver)."""

    global_step: int
    examples_seen: int
    handover: Handover
    control: Any  # the run's control point (its actor), now this driver's
    stored: Any = None  # the run's newest stored checkpoint, or None

    @property
    def model_state(self) -> dict[str, Any]:
        return self.stored.model_state if self.stored is not None else {}


def compatibility(spec: Any) -> dict[str, Any]:
    """What must not have changed for a new driver to take a run's shards over: everything that
    shapes the shards, their placement and their update rule (not the run's length, say)."""
    return {
        "cluster": spec.cluster.model_dump(mode="json"),
        "model": spec.model.model_dump(mode="json"),
        "training.mode": spec.training.mode,
        "training.optimizer": spec.training.optimizer.model_dump(mode="json"),
    }


def has_live_shards(run_id: str) -> bool:
    """Whether run `run_id` has a control point on the Ray cluster this process is connected to
    (where it is not connected, there is nothing to take over)."""
    return ray.is_initialized() and find_control(run_id) is not None


def take_over_live_run(run_id: str, spec: Any, stored: Any) -> LiveShards | None:
    """Run `run_id`'s live shards (its driver lost), now this driver's, and where the run stands;
    None where it has none to take (the run goes on from `stored`, its newest stored checkpoint):
    none were kept, they have ended, one was lost meanwhile, or they were laid out for another spec
    (then they end here)."""
    if spec.training.failure.driver_grace_s is None:
        return None
    control = find_control(run_id)
    if control is None:
        return None
    try:
        _wait_for_the_driver_to_go(run_id, control)
        handover = ray.get(control.take_over.remote(ray.get_runtime_context().get_job_id()), timeout=30)
    except ray.exceptions.RayError as exc:
        log.info("run %s's control point did not answer (%s)", run_id, first_line(exc))
        return None
    if handover is None:  # restarted since (its node lost): it knows the groups, not the shards
        control.end.remote()
        return None
    positions, why_not = _where_they_stand(handover, spec)
    if why_not is not None:
        log.info(
            "run %s's shards %s: they end, and the run goes on from its stored checkpoint", run_id, why_not
        )
        control.end.remote()  # removes the run's placement groups, which ends every shard in them
        return None
    versions = sorted({version for version, _ in positions})
    step = versions[-1]
    if len(versions) > 1:  # the driver was lost while the workers' pushes of a step were under way
        log.info(
            "the run's shards were at steps %s when its driver was lost: the update some had not "
            "applied is dropped, as a stale gradient would be, and every shard goes on from step %d",
            versions,
            step,
        )
    log.info("took over run %s's live shards at step %d: no step is redone", run_id, step)
    return LiveShards(step, positions[-1][1], handover, control, stored)


def _where_they_stand(handover: Handover, spec: Any) -> tuple[list[tuple[int, int]], str | None]:
    """Each shard's version and data position (`ParameterShard.live_position`), and why the run
    cannot go on from them, or None where it can."""
    ours = compatibility(spec)
    changed = sorted(
        k for k in ours.keys() | handover.compatible.keys() if ours.get(k) != handover.compatible.get(k)
    )
    if changed:
        return [], f"were made for another {', '.join(changed)}"
    try:
        positions = ray.get([shard.live_position.remote() for shard in handover.shards], timeout=30)
    except (ray.exceptions.GetTimeoutError, *ACTOR_GONE) as exc:
        return [], f"did not all answer ({first_line(exc)})"
    versions = sorted({version for version, _ in positions})
    # Pushes under way when the driver was lost leave the shards this far apart at most: one step
    # in sync mode, a push of each worker's in async. Further apart, the driver was lost while it
    # was loading them (a rollback's): their states are of different times.
    spread = 1 if spec.training.mode == "sync" else spec.cluster.workers + spec.cluster.spare_workers
    if versions[-1] - versions[0] > spread:
        return positions, f"are at steps {versions}, too far apart to go on from"
    return positions, None


def _wait_for_the_driver_to_go(run_id: str, control: Any) -> None:
    """Return once the run's driver is gone: its Ray job has ended (Ray says so within a second or
    two of its process's end), or it has not renewed its lease for a while; raise where it goes on
    renewing it: two drivers must never train on one run's shards."""
    job = ray.get(control.driver_job.remote(), timeout=30)
    deadline = time.monotonic() + 3 * LEASE_FRESH_S
    while (seen := ray.get(control.driver_seen_s_ago.remote(), timeout=30)) < LEASE_FRESH_S:
        if job is not None and _job_ended(job):
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"run {run_id} still has a driver on this Ray cluster (it renewed its lease {seen:.0f} s "
                "ago): stop that one (`ray job stop`, or Ctrl-C) before resuming the run"
            )
        time.sleep(0.5)


def _job_ended(job_id: str) -> bool:
    from ray._private.state import jobs  # Ray's job table (as placement.declared_dead reads its actors')

    return any(job["JobID"] == job_id and job["IsDead"] for job in jobs())
