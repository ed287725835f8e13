"""A finished run's actors, kept for the next run of the same driver process.

A new shard or worker costs seconds of CPU before it does anything (its process imports TensorFlow:
3-5 s a process on a 2-core machine), most of a short run's start, and paid again by every run of
a sweep, each mode of `towerflow compare`, each test. So a run that finishes leaves its shards and
workers, in their placement groups, here for `cluster.keep_actors_s`; the next run in this process
whose placement has the same shape (bundles, strategy) takes them, each built anew for it (a
worker's model, towers and step loop; a shard's state is loaded as a new one's is). A role whose
actors were set up for other TensorFlow settings (a sync run's shards borrow its workers' cores,
an async run's do not) ends, and new actors of it start in its bundles, while the other role's
are taken: a sync run, then an async one of the same placement (`towerflow compare`), keeps the
workers. A run of another shape, the wait's end or `release_kept_actors()` ends them, and with
them their reservations, which they hold meanwhile.

Kept: a fixed-size run's actors, each at rest. Not an elastic run's (its workers have no bundles),
nor a failed or stopped one's. A tracked run's outlive a lost driver (runtime/run_keeper.py): while
they wait, a control point of their own keeps them as the run's did (ends them once the driver has
been gone `training.failure.driver_grace_s`), until the next run's takes them over; such actors
fit tracked runs only, and the others untracked runs only. Spares end with the run; their bundles
stay, and the next run starts its spares there.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import ray

from towerflow.runtime.actors import kill_quietly

log = logging.getLogger(__name__)
# How long a kept actor may take to answer its reset (a worker: its model built anew) before it
# ends and a new one takes its place (a worker paused with the last run, say).
KEPT_ANSWER_S = 60.0
# How long the next run's sizing watches the CPUs free where the last run's actors are kept.
SETTLE_S = 0.5
# How long ending kept actors waits for Ray to count their reservations free.
FREED_WAIT_S = 2.0


@dataclass(frozen=True)
class ReuseKey:
    """What a run's actors were made for. A run takes kept actors whose placement shape it has and
    that outlive a lost driver as its own would; of those, each role's actors only where they
    were set up for its TensorFlow settings (`TFProcessConfig.settings`)."""

    placement: Hashable  # `ActorPlacement.shape`
    beyond_the_driver: bool  # a tracked run's (runtime/run_keeper.py)
    shards: Hashable  # the shards' TensorFlow settings
    workers: Hashable  # the workers'


@dataclass
class IdleActors:
    """A finished run's shards and workers, at rest in its placement groups."""

    placement: Any  # the run's ActorPlacement, its groups reserved
    shards: list[Any]  # by index; empty where they ended (`end_misfits`)
    shard_bundles: list[int]  # per shard, its bundle
    workers: dict[int, Any]  # worker id -> its actor (in that id's bundle)
    fits: ReuseKey  # what they were made for (`RunActors._reuse_key`)
    connection: str  # the Ray connection they belong to (`current_connection`)
    # A tracked run's, which outlive a lost driver: a control point of their own (run_control.py)
    # ends them once this process has been gone for `training.failure.driver_grace_s`.
    keeper: Any = None

    def fit(self, fits: ReuseKey | None) -> bool:
        """Whether a run of `fits`, on this process's Ray connection, can take their places."""
        if fits is None or self.connection != current_connection():
            return False
        return (self.fits.placement, self.fits.beyond_the_driver) == (fits.placement, fits.beyond_the_driver)

    def end_misfits(self, fits: ReuseKey) -> list[str]:
        """End the roles set up for other TensorFlow settings than `fits` asks (new actors take
        their bundles once Ray has freed them); what ended, for a log line."""
        ended = []
        if self.fits.shards != fits.shards and self.shards:
            for shard in self.shards:
                kill_quietly(shard)
            ended.append(f"{len(self.shards)} shard(s)")
            self.shards = []
        if self.fits.workers != fits.workers and self.workers:
            for worker in self.workers.values():
                kill_quietly(worker)
            ended.append(f"{len(self.workers)} worker(s)")
            self.workers = {}
        return ended

    def describe(self) -> str:
        """What is kept, for a log line."""
        kept = {"shard(s)": len(self.shards), "worker(s)": len(self.workers)}
        return " and ".join(f"{count} {role}" for role, count in kept.items() if count) or "placement groups"


class ActorPool:
    """At most one finished run's actors, until a run takes them or their wait ends."""

    def __init__(self) -> None:
        self.keeping = True  # False in a process of one run (`towerflow train`): nothing to keep for
        self._idle: IdleActors | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def keep(self, idle: IdleActors, for_s: float) -> None:
        """Keep `idle` for up to `for_s` seconds (any actors kept before end now)."""
        with self._lock:
            earlier = self._swap(idle)
            self._timer = threading.Timer(for_s, self._expire, args=(idle,))
            self._timer.daemon = True
            self._timer.start()
        # At this process's exit, before Ray's own handler disconnects it (handlers run last made,
        # first run): a tracked run's outlive the driver, and would wait out their keeper's grace.
        atexit.unregister(self.release)
        atexit.register(self.release)
        _end(earlier)
        log.info(
            "the run's %s wait %g s for this process's next run (cluster.keep_actors_s)",
            idle.describe(),
            for_s,
        )

    def take(self, fits: ReuseKey | None) -> IdleActors | None:
        """The kept actors, where their placement fits a run of `fits` on this Ray, those of a role
        set up for other TensorFlow settings ended; else None, and any kept actors end (their
        reservations would stand in the run's way). `fits` None: none could fit."""
        with self._lock:
            idle = self._swap(None)
        if idle is None:
            return None
        if idle.fit(fits):
            ended = idle.end_misfits(fits)
            log.info("the last run's %s take this run's places (TensorFlow started)", idle.describe())
            if ended:
                log.info(
                    "its %s, set up for other TensorFlow settings, end: new ones start", " and ".join(ended)
                )
            return idle
        log.info(
            "the last run's kept actors do not fit this run (another placement, or tracked unlike it): they end"
        )
        log.debug("they were kept for %s; this run asks for %s", idle.fits, fits)
        _end(idle)
        return None

    def reserved(self) -> dict[str, float]:
        """The resources the kept actors' placement groups hold on this process's Ray connection
        (every bundle's, spares' included); empty where none are kept."""
        with self._lock:
            idle = self._idle
        if idle is None or idle.connection != current_connection():
            return {}
        return idle.placement.reserved_resources()

    def release(self) -> None:
        """End the kept actors, if any, now."""
        with self._lock:
            idle = self._swap(None)
        _end(idle)

    def _expire(self, idle: IdleActors) -> None:
        with self._lock:
            if self._idle is not idle:
                return  # taken, or replaced, meanwhile
            self._swap(None)
        log.info("no run took the last run's kept actors in time: they end")
        _end(idle)

    def _swap(self, idle: IdleActors | None) -> IdleActors | None:
        earlier, self._idle = self._idle, idle
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return earlier


def current_connection() -> str | None:
    """This process's connection to Ray: its job there, on its node (a new cluster's first job has
    the same id as the last one's had)."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return f"{context.get_job_id()}@{context.get_node_id()}"


def _end(idle: IdleActors | None) -> None:
    if idle is None or idle.connection != current_connection():
        return  # Ray ended them with the connection they belonged to, or their keeper will, in its grace
    held, before = idle.placement.reserved_resources(), {}
    with contextlib.suppress(Exception):
        before = ray.available_resources()
    with contextlib.suppress(Exception):
        idle.placement.release()  # ends every actor placed in its groups: every kept one
        if before:
            _await_freed(before, held)
    if idle.keeper is not None:
        with contextlib.suppress(Exception):
            idle.keeper.close()


def _await_freed(before: dict[str, float], held: dict[str, float]) -> None:
    """Wait (up to `FREED_WAIT_S`) until Ray counts `held` free again beside what was free `before`:
    a removed placement group's resources show as free 40-110 ms later (the raylet's next report),
    and a run sized from the CPUs free just after would size itself without them. Another job
    that takes them meanwhile costs the whole wait, no more."""
    deadline = time.monotonic() + FREED_WAIT_S
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(
            free.get(resource, 0.0) + 1e-6 >= before.get(resource, 0.0) + amount
            for resource, amount in held.items()
        ):
            return
        time.sleep(0.02)


KEPT_ACTORS = ActorPool()  # this driver process's


def free_for_the_next_run() -> dict[str, float]:
    """The cluster's resources free now, counting those this process's kept actors hold as free:
    the next run takes those actors or ends them before it places its own, so a run sized from
    what is free (`cpus_per_worker: auto` on a cluster joined, an elastic run's first workers) is
    sized as it would be with nothing kept (and so fits the kept placement where the last run's
    spec was the same). Where actors are kept, the last run has just ended, and its last read
    tasks may still be giving their CPUs back (for about 0.1 s): the most free over
    `SETTLE_S` is taken."""
    held = KEPT_ACTORS.reserved()
    free = dict(ray.available_resources())
    if held:
        settled_at = time.monotonic() + SETTLE_S
        while time.monotonic() < settled_at:
            time.sleep(SETTLE_S / 5)
            for resource, amount in ray.available_resources().items():
                free[resource] = max(free.get(resource, 0.0), amount)
    for resource, amount in held.items():
        free[resource] = free.get(resource, 0.0) + amount
    return free


def release_kept_actors() -> None:
    """End the actors a finished run left for the next, and free their reservations, now rather
    than when `cluster.keep_actors_s` runs out (returns once Ray counts them free, within 2 s)."""
    KEPT_ACTORS.release()
