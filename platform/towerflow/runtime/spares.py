"""Warm spares of one kind (shards or workers): actors started with the run, idle, each in a bundle
of the run's placement groups, that take a lost actor's place instead of a new process.

A spare keeps its own bundle when it takes a place; the bundle the lost actor held gets the next
spare once Ray has declared the lost one dead (before that the bundle may still point at a dying
node, and a process placed there would die with it). A spare lost while it waits (its node, most
often) is found by a call every few seconds and made good the same way, so that a run that loses
a node keeps its spares for the next loss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from towerflow.runtime.actors import ACTOR_GONE, first_line, kill_quietly, last_line
from towerflow.runtime.placement import declared_dead

log = logging.getLogger(__name__)

PROBE_EVERY_S = 5.0  # how often an idle spare is asked whether it lives
# Spares that die before they ever answer (a node that cannot start one, say) after which no more
# are started in their place: a pool that only ever loses spares would start processes for nothing.
MAX_FAILED_STARTS = 3


class SparePool:
    def __init__(self, make: Callable[[int], Any], kind: str, answer_timeout_s: float) -> None:
        self._make = make  # bundle -> a new spare actor placed there
        self.kind = kind  # what the log calls them: "shard", "worker"
        # How long `take` waits for a spare still starting (it is further on than a new process would
        # be) before it counts it as lost (its node dying, most likely).
        self.answer_timeout_s = answer_timeout_s
        self.spares: list[tuple[Any, int]] = []  # (actor, bundle), the one to take first first
        self._freed: list[tuple[Any, int]] = []  # (lost actor, its bundle), awaiting Ray's word
        self._warming: dict[Any, Any] = {}  # actor id -> the ref of its warm-up, once asked
        # actor id -> the ref of the call in flight that asks whether it lives (the first: its start)
        self._probes: dict[Any, Any] = {}
        self._next_probe: dict[Any, float] = {}  # actor id -> when to ask next: the ones started
        self._failed_starts = 0

    def start(self, bundles: list[int]) -> None:
        for bundle in bundles:
            self._add(bundle)

    def warm(self, warm_up: Callable[[Any], Any]) -> None:
        """Have each spare that has started (as `refill` last found), and was not asked yet, get
        further ready while it waits (`warm_up`: an actor -> the ref of that call, or None: nothing
        to do yet)."""
        for actor, _ in self.spares:
            key = actor._actor_id
            if key in self._warming or key not in self._next_probe:
                continue
            ref = warm_up(actor)
            if ref is not None:
                self._warming[key] = ref

    def warmed(self) -> int:
        """How many spares in the pool have finished getting ready ahead (`warm`)."""
        refs = [self._warming[a._actor_id] for a, _ in self.spares if a._actor_id in self._warming]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else 0

    def take(self) -> tuple[Any, int] | None:
        """The first spare that has started or starts within `answer_timeout_s`, out of the pool,
        with its bundle; None when none does. One that does not is let go, and its bundle gets a new
        spare."""
        while self.spares:
            actor, bundle = self.spares.pop(0)
            warming = self._warming.get(actor._actor_id)
            self._forget(actor)
            try:  # a call now, not its start's: it may have died since
                ray.get(actor.__ray_ready__.remote(), timeout=self.answer_timeout_s)
                if warming is not None:  # not half-way through it as it takes the place
                    _finish_warming(warming, self.answer_timeout_s)
                return actor, bundle
            except (ray.exceptions.GetTimeoutError, *ACTOR_GONE) as exc:
                log.info(
                    "a spare %s did not answer (%s): a new one takes its bundle", self.kind, first_line(exc)
                )
                kill_quietly(actor)
                self.free(actor, bundle)
        return None

    def free(self, lost: Any, bundle: int) -> None:
        """`lost`'s bundle (a spare took its place, or a spare taken failed) gets a new spare once
        Ray frees it (`refill`)."""
        self._freed.append((lost, bundle))

    def refill(self) -> None:
        """A new spare in each freed bundle whose lost actor Ray has declared dead by now; the
        others wait for a later call (the driver's every turn). Spares found lost while they wait
        free their bundles first."""
        self._find_lost()
        waiting = []
        for lost, bundle in self._freed:
            if declared_dead(lost):
                self._add(bundle)
            else:
                waiting.append((lost, bundle))
        self._freed = waiting

    def kill(self) -> None:
        for actor, _ in self.spares:
            kill_quietly(actor)
            self._forget(actor)
        self.spares, self._freed = [], []

    def _find_lost(self) -> None:
        """Ask each idle spare whether it lives, every PROBE_EVERY_S, without waiting for the answer:
        one whose call failed is let go and its bundle freed."""
        now = time.monotonic()
        for actor, bundle in list(self.spares):
            key = actor._actor_id
            probe = self._probes.get(key)
            if probe is None:
                if now >= self._next_probe.get(key, 0.0):
                    self._probes[key] = actor.__ray_ready__.remote()
                continue
            if not ray.wait([probe], timeout=0)[0]:
                continue  # still starting, or busy warming up: asked again once it answers
            del self._probes[key]
            try:
                ray.get(probe)
                self._next_probe[key] = now + PROBE_EVERY_S
            except ACTOR_GONE as exc:
                self._failed_starts += key not in self._next_probe  # never answered: lost as it started
                self.spares.remove((actor, bundle))
                self._forget(actor)
                kill_quietly(actor)
                if self._failed_starts >= MAX_FAILED_STARTS:
                    log.warning(
                        "%d spare %ss died before they started (the last: %s): no more are started",
                        self._failed_starts,
                        self.kind,
                        last_line(exc),
                    )
                    continue
                log.info(
                    "a spare %s was lost while it waited (%s): a new one takes its bundle",
                    self.kind,
                    first_line(exc),
                )
                self.free(actor, bundle)

    def _forget(self, actor: Any) -> None:
        for calls in (self._warming, self._probes, self._next_probe):
            calls.pop(actor._actor_id, None)

    def _add(self, bundle: int) -> None:
        actor = self._make(bundle)
        self._probes[actor._actor_id] = actor.__ray_ready__.remote()  # answered once it has started
        self.spares.append((actor, bundle))


def _finish_warming(ref: Any, timeout_s: float) -> None:
    """Wait for a spare's warm-up; one that failed in the user's code leaves the spare as ready as
    it was (what it would have done happens in its first step instead)."""
    try:
        ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        log.info("a spare could not get ready ahead: %s", first_line(exc))
