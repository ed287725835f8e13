"""A tracked run's shards and workers outlive a lost driver (`training.failure.driver_grace_s`), so
that a driver resuming the run takes them over instead of starting again from the stored checkpoint.

The shards, the workers in the run's placement groups and the groups themselves are detached from
the driver that made them; the run's control point (run_control.py), detached too, holds what a
new driver needs to take them over (a `Handover`) and ends them once the run has had no driver for
the grace period. A new driver first fences the shards and workers against the old one, should it
wake (runtime/fencing.py), then brings the workers to rest (their data pipeline ended with the
old driver: each ends its run after its step), then goes on from the shards' version and from the
data position the gradients they took tell, with the workers' own model state; no step is redone,
and only the driver and its data pipeline start again. Warm spares end; new ones start. The
workers' records of their last steps (those the lost driver may not have logged, and those taken
without it) reach the new driver's hooks as past steps: the run's metrics have no gap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from towerflow.errors import ClusterError
from towerflow.runtime.actors import ACTOR_GONE, first_line, kill_quietly
from towerflow.runtime.fencing import fence_taken_actors
from towerflow.runtime.protocol import protocol_for
from towerflow.runtime.run_control import LEASE_FRESH_S, ControlPoint, ended_for_good, find_control

log = logging.getLogger(__name__)
# How long a lost driver's workers get to end their runs (a step, where their data has not ended
# already) before the shards are finished to release them, and again after that before they are
# killed (new workers start in their places).
REST_S = 30.0
RELEASED_REST_S = 10.0
# Sync: once one worker has come to rest, how long the others get to follow before the shards are
# finished to release them. Sync workers end a step together, so one still running then waits in
# its push for a gradient that a peer whose data ended with the driver will not send.
PEER_REST_S = 5.0
# How long a resume waits for the run's control point to answer: lost with its node (the driver's,
# or the head), Ray starts it again once the GCS has declared that node dead (its health checks
# failed: tens of seconds).
CONTROL_RESTART_S = 120.0


@dataclass
class Handover:
    """What a driver needs to take a run's live shards over: told to the control point by the driver
    that has them (again whenever they change), read by the next."""

    placement: Any  # the run's ActorPlacement, with its placement groups
    shards: list[Any]  # the shard actors, by index
    shard_bundles: list[int]  # per shard, its bundle
    spares: list[Any] = field(default_factory=list)  # the spare shards: they end, new ones start
    compatible: dict[str, Any] = field(default_factory=dict)  # what a taker's spec must match
    workers: dict[int, Any] = field(default_factory=dict)  # worker id -> its actor (in a bundle)
    spare_workers: list[Any] = field(default_factory=list)  # they end, new ones start


@dataclass
class KeptWorker:
    """A lost driver's worker, at rest and taken over: its actor, the number of its last run and
    the records of its last steps (`StepLoop.recent_records`)."""

    actor: Any
    last_run: int
    records: list[Any] = field(default_factory=list)


@dataclass
class LiveRun:
    """Where a run goes on from when its new driver took its live shards and workers over: the
    shards' version and the data position the gradients they took tell, the workers kept, and the
    stored checkpoint it would otherwise have gone on from (a later rollback's fallback)."""

    global_step: int
    examples_seen: int
    handover: Handover
    control: ControlPoint  # the run's, now this driver's: renewing the lease since the take-over
    stored: Any = None  # the run's newest stored checkpoint, or None
    workers: dict[int, KeptWorker] = field(default_factory=dict)  # by worker id
    term: int = 1  # the term its actors take this driver's orders under (runtime/fencing.py)

    def recent_records(self) -> list[Any]:
        """The kept workers' records of their last steps, in step order: steps the lost driver may
        not have logged, and those taken after it was lost (the new driver logs them)."""
        records = [record for worker in self.workers.values() for record in worker.records]
        return sorted(records, key=lambda r: (r.step, r.finished_at))

    @property
    def model_state(self) -> dict[str, Any]:
        """The stored checkpoint's non-trainable state: new workers take it where none was kept
        (kept workers hold a newer one)."""
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


def take_over_live_run(run_id: str, spec: Any, stored: Any) -> LiveRun | None:
    """Run `run_id`'s live shards and workers (its driver lost), now this driver's, and where the
    run stands; None where it has none to take (the run goes on from `stored`, its newest stored
    checkpoint): none were kept, they have ended, one was lost meanwhile, or they were laid out for
    another spec (then they end here)."""
    if spec.training.failure.driver_grace_s is None:
        return None
    control = find_control(run_id)
    if control is None:
        log.info("run %s has no control point on this Ray cluster: no live shards to take over", run_id)
        return None
    try:
        gone = _wait_for_the_driver_to_go(run_id, control)
        answer = ray.get(control.take_over.remote(ray.get_runtime_context().get_job_id(), gone), timeout=30)
    except ray.exceptions.RayError as exc:
        log.warning(
            "run %s's control point did not answer (%s): the run goes on from its stored checkpoint, "
            "and its kept shards hold their resources until its grace period ends (driver_grace_s)",
            run_id,
            first_line(exc),
        )
        return None
    if answer.taken_by is not None:
        raise ClusterError(
            f"run {run_id} was taken over by another driver (Ray job {answer.taken_by}) while this one "
            f"waited for its lost driver (Ray job {gone}) to go: that driver has the run now; stop it "
            "(`ray job stop`) before resuming the run here"
        )
    handover = answer.handover
    if handover is None:  # started again without its record: it knows the groups, not the shards
        log.info(
            "run %s's control point knows no live shards (started again without its record): they end", run_id
        )
        control.end.remote()
        return None
    # Renewed from here on: fencing, the workers' rest and the new driver's start take longer than a
    # lease, and a lapsed one would let a second resume take the run from this driver meanwhile.
    lease = ControlPoint(run_id, actor=control)
    why_not = _changed(handover, spec)
    workers: dict[int, KeptWorker] = {}
    term = 1
    if why_not is None:
        try:
            # First: from here on the actors refuse the old driver's orders, should it wake.
            term = fence_taken_actors([*handover.shards, *handover.workers.values()], run_id)
            workers = _bring_to_rest(handover, term, sync=spec.training.mode == "sync")
            positions, why_not = _where_they_stand(handover, spec)
        except BaseException:
            lease.let_go()  # no driver goes on with the run: its lease lapses, its grace period runs
            raise
    if why_not is not None:
        log.info(
            "run %s's shards %s: they end, and the run goes on from its stored checkpoint", run_id, why_not
        )
        lease.end_the_run()  # removes the run's placement groups, which ends every shard in them
        return None
    versions = sorted({version for version, *_ in positions})
    step = versions[-1]
    if len(versions) > 1:  # a step's pushes under way when the driver was lost, or async's drift
        log.info(
            "the run's shards were at steps %s when its driver was lost: an update some had not "
            "applied is dropped, as a stale gradient would be, and every shard goes on from step %d",
            versions,
            step,
        )
    log.info(
        "took over run %s's live shards at step %d and %d of its workers: no step is redone",
        run_id,
        step,
        len(workers),
    )
    return LiveRun(step, positions[-1][1], handover, lease, stored, workers, term)


def _changed(handover: Handover, spec: Any) -> str | None:
    """Why the shards cannot serve this spec (what changed), or None."""
    ours = compatibility(spec)
    changed = sorted(
        k for k in ours.keys() | handover.compatible.keys() if ours.get(k) != handover.compatible.get(k)
    )
    return f"were made for another {', '.join(changed)}" if changed else None


def _bring_to_rest(handover: Handover, term: int, sync: bool) -> dict[int, KeptWorker]:
    """The lost driver's workers, each with its run ended: asked to stop after their step (sync
    workers end a step together, so the shards end at one version); those still running after
    `REST_S` (sync: `PEER_REST_S` after the first came to rest) are released by finishing the
    shards, and killed `RELEASED_REST_S` later (new workers take their places). Its warm spares
    end (new ones start)."""
    for actor in handover.spare_workers:
        kill_quietly(actor)
    kept: dict[int, KeptWorker] = {}
    waiting = dict(handover.workers)
    for round_, wait_s in enumerate((REST_S, RELEASED_REST_S)):
        if not waiting:
            break
        if round_:
            log.info("worker(s) %s still running: the shards are finished to release them", sorted(waiting))
            for shard in handover.shards:
                shard.finish.remote(term=term)
        asked = {worker_id: actor.rest.remote(wait_s) for worker_id, actor in waiting.items()}
        _wait_for_rest(list(asked.values()), wait_s + 5, PEER_REST_S if sync and not round_ else None)
        for worker_id, ref in asked.items():
            try:
                rested = ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:  # the wait cut short (a peer at rest): running
                continue
            except ray.exceptions.RayError:  # gone, or not answering at all: not asked again
                kill_quietly(waiting.pop(worker_id))
                continue
            if rested is not None:
                last_run, records = rested
                kept[worker_id] = KeptWorker(waiting.pop(worker_id), last_run, records)
    for actor in waiting.values():
        kill_quietly(actor)
    return kept


def _wait_for_rest(refs: list[Any], timeout_s: float, after_first_s: float | None) -> None:
    """Until every worker has answered `rest`, `timeout_s` has passed, or `after_first_s` has
    passed since the first answered."""
    deadline = time.monotonic() + timeout_s
    pending = refs
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if ready and after_first_s is not None:
            deadline = min(deadline, time.monotonic() + after_first_s)


def _where_they_stand(handover: Handover, spec: Any) -> tuple[list[tuple[int, int, int]], str | None]:
    """Each shard's version, data position and load (`ParameterShard.live_position`), and why the
    run cannot go on from them, or None where it can."""
    try:
        positions = ray.get([shard.live_position.remote() for shard in handover.shards], timeout=30)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError, *ACTOR_GONE) as exc:
        return [], f"did not all answer ({first_line(exc)})"
    if any(position is None for position in positions):
        return [], "were not loaded yet (their driver was lost as the run started)"
    if len({loading for *_, loading in positions}) > 1:
        return positions, "were not all given the same load (their driver was lost while it loaded them)"
    versions = sorted({version for version, *_ in positions})
    # Pushes under way when the driver was lost leave sync shards one step apart at most. Async
    # shards drift apart by the late gradients some dropped and others applied, any number of steps.
    if not protocol_for(spec.training.mode).versions_drift and versions[-1] - versions[0] > 1:
        return positions, f"are at steps {versions}, too far apart to go on from"
    return positions, None


def _wait_for_the_driver_to_go(run_id: str, control: Any) -> str | None:
    """The run's driver's Ray job (None where it has none), once that driver is gone: its job has
    ended (Ray says so within a second or two of its process's end), or it has not renewed its
    lease for a while; raise where it goes on renewing it: two drivers must never train on one
    run's shards."""
    job = _first_answer(run_id, control)
    deadline = time.monotonic() + 3 * LEASE_FRESH_S
    while (seen := ray.get(control.driver_seen_s_ago.remote(), timeout=30)) < LEASE_FRESH_S:
        if job is not None and _job_ended(job):
            return job
        if time.monotonic() > deadline:
            raise ClusterError(
                f"run {run_id} still has a driver on this Ray cluster (it renewed its lease {seen:.0f} s "
                "ago): stop that one (`ray job stop`, or Ctrl-C) before resuming the run"
            )
        time.sleep(0.5)
    return job


def _first_answer(run_id: str, control: Any) -> str | None:
    """The driver's job, as the run's control point says once it answers: one that Ray is
    starting again (its node lost, or drained and lost) answers once it has been
    (CONTROL_RESTART_S at most)."""
    started = said = time.monotonic()
    while True:
        try:
            return ray.get(control.driver_job.remote(), timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
            if ended_for_good(exc) or time.monotonic() - started > CONTROL_RESTART_S:
                raise
            time.sleep(1)  # unavailable says so at once
            if time.monotonic() - said >= 10:
                said = time.monotonic()
                log.info(
                    "run %s's control point has not answered for %.0f s (lost with its node? Ray "
                    "starts it again once the node is declared dead): waiting",
                    run_id,
                    said - started,
                )


def _job_ended(job_id: str) -> bool:
    from ray._private.state import jobs  # Ray's job table (as placement.declared_dead reads its actors')

    return any(job["JobID"] == job_id and job["IsDead"] for job in jobs())
