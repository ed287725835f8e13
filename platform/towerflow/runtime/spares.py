"""Warm spares of one kind (shards or workers): actors started with the run, idle, each in a bundle
of the run's placement groups, that take a lost actor's place instead of a new process.

A spare keeps its own bundle when it takes a place; the bundle the lost actor held gets the next
spare once Ray has declared the lost one dead (before that the bundle may still point at a dying
node, and a process placed there would die with it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

from towerflow.runtime.actors import ACTOR_GONE, first_line, kill_quietly
from towerflow.runtime.placement import declared_dead

log = logging.getLogger(__name__)


class SparePool:
    def __init__(self, make: Callable[[int], Any], kind: str, answer_timeout_s: float) -> None:
        self._make = make  # bundle -> a new spare actor placed there
        self.kind = kind  # what the log calls them: "shard", "worker"
        # How long `take` waits for a spare still starting (it is further on than a new process would
        # be) before it counts it as lost (its node dying, most likely).
        self.answer_timeout_s = answer_timeout_s
        self.spares: list[tuple[Any, int]] = []  # (actor, bundle), the one to take first first
        self._freed: list[tuple[Any, int]] = []  # (lost actor, its bundle), awaiting Ray's word
        self._started: dict[Any, Any] = {}  # actor id -> the ref of its start
        self._warming: dict[Any, Any] = {}  # actor id -> the ref of its warm-up, once asked

    def start(self, bundles: list[int]) -> None:
        for bundle in bundles:
            self._add(bundle)

    def warm(self, warm_up: Callable[[Any], Any]) -> None:
        """Have each spare that has started, and was not asked yet, get further ready while it waits
        (`warm_up`: an actor -> the ref of that call, or None: nothing to do yet)."""
        for actor, _ in self.spares:
            key = actor._actor_id
            if key in self._warming or not ray.wait([self._started[key]], timeout=0)[0]:
                continue
            ref = warm_up(actor)
            if ref is not None:
                self._warming[key] = ref

    def take(self) -> tuple[Any, int] | None:
        """The first spare that has started or starts within `answer_timeout_s`, out of the pool,
        with its bundle; None when none does. One that does not is let go, and its bundle gets a new
        spare."""
        while self.spares:
            actor, bundle = self.spares.pop(0)
            self._started.pop(actor._actor_id)
            warming = self._warming.pop(actor._actor_id, None)
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
        others wait for a later call (the driver's every turn)."""
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
        self.spares, self._freed, self._started, self._warming = [], [], {}, {}

    def _add(self, bundle: int) -> None:
        actor = self._make(bundle)
        self._started[actor._actor_id] = actor.__ray_ready__.remote()
        self.spares.append((actor, bundle))


def _finish_warming(ref: Any, timeout_s: float) -> None:
    """Wait for a spare's warm-up; one that failed in the user's code leaves the spare as ready as
    it was (what it would have done happens in its first step instead)."""
    try:
        ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        log.info("a spare could not get ready ahead: %s", first_line(exc))
