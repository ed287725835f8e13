"""A running job's control point on the Ray cluster: `towerflow scale` leaves a new worker count
there and the controller picks it up at its next poll; and, for a run whose shards outlive a lost
driver (`training.failure.driver_grace_s`, runtime/run_keeper.py), the keeper of those shards.

It is a named actor with no resources, in the `towerflow` namespace under the run's id, so any
process connected to the same cluster (a `ray job submit` driver or a shell) finds it. It sits on
the driver's node and Ray restarts it should it die: losing it must never fail a training run.

Where the run's shards are kept, it is detached from its driver, holds what a new driver needs to
take them over (`remember`, `take_over`), and knows its driver is there by the lease a thread of
the driver's process renews every few seconds: a driver stuck in a long wait still renews it, a
lost one does not. After `grace_s` without a renewal it removes the run's placement groups, which
ends every shard and worker placed in them, and then itself. A new driver takes the run over only
once the lease has lapsed, and only from the driver it saw go (`take_over` is a compare-and-set:
of two resumes started together, one gets the run); the lease is then the new driver's, and
the old one, should it wake (paused, or cut off from the cluster, not lost), hears so and stops
before it acts on the run again (`ControlPoint.confirm`); where it does not hear, the run's
actors refuse its orders (runtime/fencing.py): two drivers never steer one run. Otherwise it
lives as long as its driver. What it is told it also writes to the GCS's key-value store, so
that restarted by Ray (its process or its node lost: the driver's node, with the driver on it)
it knows the run again, and a new driver takes the shards over all the same; under GCS fault
tolerance that store outlives the head too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from towerflow.errors import ClusterError, RunEndedWhileAway, RunTakenOver
from towerflow.runtime.actors import kill_quietly

log = logging.getLogger(__name__)

NAMESPACE = "towerflow"
RENEW_EVERY_S = 2.0  # how often the driver renews its lease on a kept run
LEASE_FRESH_S = 5 * RENEW_EVERY_S  # renewed within this: the run has a driver
LOOK_EVERY_S = 2.0  # how often the keeper looks at the lease
NAME_FREED_WITHIN_S = 30.0  # a control point ended just now: how long its name may stay taken
# A driver whose lease was last renewed longer ago than this asks before it acts on the run: it
# may have lapsed (a new driver takes a run over LEASE_FRESH_S after the last renewal).
ASK_AFTER_S = LEASE_FRESH_S / 2
ASK_WAIT_S = 2.0  # how long such a question waits for its answer


@dataclass(frozen=True)
class Lease:
    """A control point's answer to a driver renewing its lease."""

    driver_job: str | None  # the Ray job of the run's driver, as the control point knows it
    knows_run: bool  # it holds the run's handover (one restarted without its record does not)

    def taken_from(self, job: str) -> bool:
        """Whether another driver than `job`'s has the run now."""
        return self.driver_job is not None and self.driver_job != job


@dataclass(frozen=True)
class Takeover:
    """A control point's answer to a driver taking its run over."""

    handover: Any  # runtime/run_keeper.Handover; None where none is known (a keeper restarted since)
    taken_by: str | None = None  # refused: the Ray job of the driver that took the run over first


def control_name(run_id: str) -> str:
    return f"run-{run_id}"


@ray.remote(num_cpus=0, max_restarts=-1)
class RunControl:
    def __init__(
        self,
        run_id: str = "",
        grace_s: float | None = None,
        group_names: tuple[str, ...] = (),
        made: str = "",
    ) -> None:
        """`grace_s`: a kept run's, whose driver renews its lease, and whose shards are in the
        placement groups of these names (see the module's docstring). By name: Ray restarts this
        actor with these arguments, so one restarted (its node lost) still ends them. `made`: an
        id of this control point's own, which its record carries, so that one restarted reads
        its own record back and a new one of the run no earlier one's."""
        self._run_id = run_id
        self._workers: int | None = None
        self._renewed = time.monotonic()
        self._handover: Any = None  # runtime/run_keeper.Handover, of a kept run
        self._group_names = tuple(group_names)
        self._driver_job: str | None = None  # the Ray job of the driver that keeps the run
        self._keeping = grace_s is not None
        self._noting = threading.Event()  # set: a newer record to write
        self._writing = threading.Lock()  # held while the record is written, or deleted at the end
        self._ended = False
        self._made = made
        if self._keeping:  # from the start: a driver lost before `keep` leaves nothing behind
            self._driver_job, self._handover = recall(run_id, made)  # started again by Ray, it wrote one
            threading.Thread(
                target=self._watch, args=(grace_s,), name="towerflow-keeper", daemon=True
            ).start()
            threading.Thread(target=self._write_notes, name="towerflow-record", daemon=True).start()

    def scale(self, workers: int) -> bool:
        """Leave a worker count; False (and nothing left) where the run has no driver to pick it
        up: a count the user was told failed is not applied by a later driver."""
        if self._keeping and self.driver_seen_s_ago() >= LEASE_FRESH_S:
            return False
        self._workers = workers
        return True

    def wanted_workers(self) -> int | None:
        return self._workers

    # -- the keeper of a kept run's shards -------------------------------------------------------
    def keep(self, driver_job: str) -> None:
        """Keep the run's shards while it has a driver (of Ray job `driver_job`: its placement
        groups are made) and the grace period after. Not where another driver has the run."""
        if not self._from_its_driver(driver_job):
            return
        self._driver_job = driver_job
        self._note()

    def pid(self) -> int:
        """This actor's process (tests kill it for real)."""
        import os

        return os.getpid()

    def renew(self, driver_job: str) -> Lease:
        """The driver of Ray job `driver_job` is there: its lease is renewed, unless another
        driver has taken the run over (the answer says which). One restarted by Ray reads the
        handover back from its record; where it could not, the driver tells it again."""
        if self._from_its_driver(driver_job):
            self._renewed = time.monotonic()
        return Lease(self._driver_job, self._handover is not None)

    def _from_its_driver(self, driver_job: str) -> bool:
        """Whether a call of Ray job `driver_job` is the run's driver's (or the run has none yet)."""
        return self._driver_job in (None, driver_job)

    def driver_seen_s_ago(self) -> float:
        """Since the driver last renewed its lease; 0 for a run not kept, whose control point ends
        with its driver (while it is there, so is the driver)."""
        return time.monotonic() - self._renewed if self._keeping else 0.0

    def remember(self, handover: Any, driver_job: str) -> None:
        if not self._from_its_driver(driver_job):
            return  # a driver the run was taken from, not yet told
        self._handover = handover
        self._note()

    def driver_job(self) -> str | None:
        return self._driver_job

    def take_over(self, driver_job: str, gone_job: str | None) -> Takeover:
        """The run, now the new driver's (of Ray job `driver_job`, which renews the lease from here
        on), and what it needs to take the shards over; refused where the run's driver is no longer
        `gone_job`, the one that driver saw go: another took the run over meanwhile (two resumes
        started together). A compare-and-set, so that only one of them steers the run."""
        if self._driver_job not in (None, gone_job, driver_job):
            return Takeover(None, taken_by=self._driver_job)
        self._renewed, self._driver_job = time.monotonic(), driver_job
        self._note()
        return Takeover(self._handover)

    def end(self) -> None:
        """End the run's shards (remove its placement groups) and this actor: the run is over."""
        from ray.util import get_placement_group
        from ray.util.placement_group import remove_placement_group

        for name in self._group_names:  # ends every actor placed in it: the shards and their spares
            with contextlib.suppress(Exception):  # not made (a driver lost before), or removed
                remove_placement_group(get_placement_group(name))
        with self._writing:  # after any write under way, and no write after it
            self._ended = True
            forget(self._run_id)
        kill_quietly(ray.get_runtime_context().current_actor)

    def _note(self) -> None:
        """Have what a new driver needs written where this actor, restarted, finds it again: by a
        thread of its own, so that no call (a renewal) waits on the GCS (away with the head)."""
        self._noting.set()

    def _write_notes(self) -> None:
        from ray import cloudpickle
        from ray.experimental import internal_kv

        while self._noting.wait():
            self._noting.clear()
            record = cloudpickle.dumps((self._made, self._driver_job, self._handover))  # the latest
            with self._writing, contextlib.suppress(Exception):  # the GCS gone for good: no restart
                if not self._ended:
                    internal_kv._internal_kv_put(
                        _record_key(self._run_id), record, overwrite=True, namespace=NAMESPACE
                    )

    def _watch(self, grace_s: float) -> None:
        while time.monotonic() - self._renewed <= grace_s:
            time.sleep(LOOK_EVERY_S)
        log.warning(
            "run %s has had no driver for %.0f s (training.failure.driver_grace_s): its shards end",
            self._run_id,
            grace_s,
        )
        self.end()


class ControlPoint:
    """The controller's side: create the named actor (or go on with a lost driver's), ask it
    without blocking, and renew the lease of a kept run."""

    def __init__(
        self,
        run_id: str,
        *,
        grace_s: float | None = None,
        group_names: tuple[str, ...] = (),
        actor: Any = None,
    ) -> None:
        """`grace_s`: the run's shards, in the placement groups of `group_names`, are kept beyond
        this driver for that long (`keep` follows once the groups are made); `actor`: the control
        point of a lost driver, whose kept shards this driver took over."""
        self.actor = actor if actor is not None else _create(run_id, grace_s, group_names)
        self._run_id = run_id
        self._asked: Any = None
        self._seen: int | None = None
        self._renewing: threading.Event | None = None
        self._handover: Any = None  # the last told, told again to a control point Ray restarted
        self._job = ray.get_runtime_context().get_job_id()
        self.taken_by: str | None = None  # another driver's job, which took the run over
        self._held_at = self._asked_at = time.monotonic()  # the lease last renewed; last asked
        if actor is not None or grace_s is not None:
            self._start_renewing()

    def keep(self) -> None:
        """Have the control point keep the run's shards: their placement groups are made."""
        ray.get(self.actor.keep.remote(self._job))

    def remember(self, handover: Any) -> None:
        self._handover = handover
        self.actor.remember.remote(handover, self._job)

    def confirm(self) -> None:
        """Raise RunTakenOver where the run is no longer this driver's; called before the
        controller acts on the run. Free while the lease is fresh; where its last renewal is older
        than ASK_AFTER_S (this process was paused, or the control point did not answer) another
        driver may have taken the run over, so the control point is asked, for ASK_WAIT_S at most
        and once per ASK_AFTER_S at most. Unanswered, the driver goes on: its loop never waits on
        the cluster (a control point may not answer while the head is away), and its lease thread
        goes on asking."""
        if self._renewing is None:
            return  # a run whose driver is its only one: nobody takes it over
        now = time.monotonic()
        if self.taken_by is None and min(now - self._held_at, now - self._asked_at) > ASK_AFTER_S:
            self._asked_at = now
            try:
                self._heard(ray.get(self.actor.renew.remote(self._job), timeout=ASK_WAIT_S))
            except ray.exceptions.RayError as exc:
                if ended_for_good(exc):
                    why = _cause(exc)
                    raise RunEndedWhileAway(
                        f"run {self._run_id}'s control point has ended (its shards were ended after "
                        "training.failure.driver_grace_s without this driver, or another driver ended "
                        f"the run; Ray says: {why}): this driver stops. Resume the run from its last "
                        f"checkpoint with `towerflow train <spec> --resume {self._run_id}`"
                    ) from exc
                # restarting, or slow: the next turn asks again
                log.debug("run %s's control point did not answer within %.0f s", self._run_id, ASK_WAIT_S)
        if self.taken_by is not None:
            raise RunTakenOver(
                f"run {self._run_id} was taken over by another driver (Ray job {self.taken_by}) while "
                f"this one had not renewed its lease for {time.monotonic() - self._held_at:.0f} s "
                "(paused, or cut off from the cluster): this driver stops and leaves the run to it"
            )

    def let_go(self) -> None:
        """Stop renewing the lease, leaving the control point to the driver that took the run over."""
        if self._renewing is not None:
            self._renewing.set()

    def _heard(self, lease: Lease) -> None:
        if lease.taken_from(self._job):
            self.taken_by = lease.driver_job
            self.let_go()
            return
        self._held_at = time.monotonic()
        if not lease.knows_run and self._handover is not None:  # restarted by Ray: tell it again
            self.actor.keep.remote(self._job)
            self.actor.remember.remote(self._handover, self._job)

    def new_worker_count(self) -> int | None:
        """A worker count set since the last call, else None; never waits."""
        if self._asked is None:
            self._asked = self.actor.wanted_workers.remote()
        ready, _ = ray.wait([self._asked], timeout=0)
        if not ready:
            return None
        try:
            wanted = ray.get(self._asked)
        except ray.exceptions.RayError:  # restarting: ask again next time
            return None
        finally:
            self._asked = None
        if wanted is None or wanted == self._seen:
            return None
        self._seen = wanted
        return wanted

    def close(self) -> None:
        if self._renewing is not None:
            self._renewing.set()
        ray.kill(self.actor)
        if self._renewing is not None:  # a kept run's: its record goes with it
            forget(self._run_id)

    def end_the_run(self) -> None:
        """End the run's kept shards (their placement groups removed) and the control point."""
        if self._renewing is not None:
            self._renewing.set()
        self.actor.end.remote()

    def _start_renewing(self) -> None:
        if self._renewing is not None:
            return
        stop = self._renewing = threading.Event()
        actor = self.actor

        def renew() -> None:  # a thread of its own: a driver busy or waiting in its loop renews too
            while not stop.wait(RENEW_EVERY_S):
                with contextlib.suppress(Exception):
                    self._heard(ray.get(actor.renew.remote(self._job), timeout=LEASE_FRESH_S))

        threading.Thread(target=renew, name="towerflow-lease", daemon=True).start()


def ended_for_good(exc: Exception) -> bool:
    """Whether a call's error says the control point is dead and not restarting. Ray answers
    ActorDiedError also while it restarts one whose node was drained (a preempted instance) and
    then lost; that error says `preempted` (measured, Ray 2.60: two calls so refused in the 3 s
    before the control point answered again on another node)."""
    return isinstance(exc, ray.exceptions.ActorDiedError) and not exc.preempted


def _cause(exc: Exception) -> str:
    """Ray's cause in its ActorDiedError (killed, its node died, ...): the last of its lines that
    is not one of its tab-indented fields (class name, actor id, pid, ...)."""
    lines = [line for line in str(exc).splitlines() if line.strip() and not line.startswith("\t")]
    return lines[-1].strip() if lines else type(exc).__name__


def find_control(run_id: str) -> Any:
    """Run `run_id`'s control point on this cluster, or None."""
    try:
        return ray.get_actor(control_name(run_id), namespace=NAMESPACE)
    except ValueError:
        return None


def forget(run_id: str) -> None:
    """Delete what run `run_id`'s control point wrote down (its run is over)."""
    from ray.experimental import internal_kv

    with contextlib.suppress(Exception):  # the GCS away: a few hundred bytes stay behind
        internal_kv._internal_kv_del(_record_key(run_id), namespace=NAMESPACE)


def _record_key(run_id: str) -> bytes:
    return f"control-{run_id}".encode()


def recall(run_id: str, made: str) -> tuple[str | None, Any]:
    """What run `run_id`'s control point `made` wrote down before Ray restarted it: its driver's
    job and the handover; (None, None) where it wrote nothing (it has just been made: a record
    there is an earlier control point's of the run, left where the GCS was away at its end)."""
    from ray import cloudpickle
    from ray.experimental import internal_kv

    try:
        record = internal_kv._internal_kv_get(_record_key(run_id), namespace=NAMESPACE)
        writer, job, handover = cloudpickle.loads(record) if record else (None, None, None)
    except Exception as exc:  # an actor of the run gone for good, say: the driver tells it again
        log.warning("run %s's control point could not read back its record: %s", run_id, exc)
        return None, None
    return (job, handover) if writer == made else (None, None)


def _create(run_id: str, grace_s: float | None, group_names: tuple[str, ...]) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    lifetime = {"lifetime": "detached"} if grace_s is not None else {}
    options = dict(name=control_name(run_id), namespace=NAMESPACE, scheduling_strategy=here, max_restarts=-1)
    deadline = time.monotonic() + NAME_FREED_WITHIN_S
    while True:
        try:
            made = uuid.uuid4().hex
            return RunControl.options(**options, **lifetime).remote(run_id, grace_s, group_names, made)
        except ValueError:  # the name is still a control point's that was just ended (a lost driver's)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def request_scale(run_id: str, workers: int) -> None:
    """Ask the running job `run_id` for `workers` workers (from any process connected to its cluster)."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: a run needs at least one worker")
    actor = find_control(run_id)
    if actor is None or not ray.get(actor.scale.remote(workers)):
        raise ClusterError(
            f"no running towerflow job with run id {run_id} on this Ray cluster (it has ended, or runs on "
            "another cluster: set RAY_ADDRESS to that cluster's head)"
        )
