"""Fencing a run's actors against a driver that is no longer the run's.

A driver paused or cut off from the cluster past its lease may wake after another driver has taken
its run over (runtime/run_keeper.py). Its lease check (run_control.py) tells it so where the
control point answers; the actors themselves make sure of it where it does not. Each shard and
worker holds the term of the driver it takes its orders from, a number that each take-over raises:
the new driver fences every actor it takes with a term above any they hold, and a call that changes
the run (loading or finishing a shard, resizing it, writing a checkpoint, starting a worker's run)
carries its driver's term and is refused (`FencedOut`) below the actor's. A worker's answer
to every poll carries its term too, so that an old driver hears of the take-over before it decides
anything (a silent worker's replacement, say). A fencing token, as a lock service's: the check sits
where the damage would be done, not in the process that may be stale.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from towerflow.errors import FencedOut
from towerflow.runtime.actors import answers_within

log = logging.getLogger(__name__)
# How long a take-over waits for its actors to answer, each of its two asks (a hung one costs it that).
FENCE_ANSWER_S = 10.0


class DriverTerm:
    """Mixed into the shard and worker actors: the term of the driver they take orders from."""

    _term = 0

    def term(self) -> int:
        return self._term

    def fence(self, term: int) -> int:
        """Take orders from drivers of `term` and later only; returns the term now held."""
        self._term = max(self._term, term)
        return self._term

    def _forget_term(self) -> None:
        """A kept actor's next run (runtime/actor_pool.py): a new run, whose first driver is term 0."""
        self._term = 0

    def _obey(self, term: int, what: str) -> None:
        """Refuse `what` from a driver of an earlier term than this actor's; a later one fences the
        earlier out (an actor it started takes its term from its first order)."""
        if term < self._term:
            raise FencedOut(
                f"{what} refused: this actor takes its orders from a newer driver of the run (term "
                f"{self._term}; the call's {term})",
                term=self._term,
            )
        self._term = term


def fenced_out(whose: str, term: int, ours: int) -> FencedOut:
    """The driver's own finding that `whose` (its workers, its actors) answer to a newer driver."""
    return FencedOut(
        f"{whose} take their orders from a newer driver of the run (term {term}; this driver's {ours})"
    )


def fence_taken_actors(actors: Sequence[Any], run_id: str) -> int:
    """Fence a taken-over run's live actors against its earlier drivers; returns the new driver's
    term, one above any they hold. An actor that does not answer is left out: it is gone, or
    will be found lost (a taken-over shard that does not answer ends the take-over). Raise
    FencedOut where one already holds a later term: a driver that took the run over after this
    one fenced it in between."""
    term = max(held_terms(actors, FENCE_ANSWER_S), default=0) + 1
    held = answers_within([actor.fence.remote(term) for actor in actors], FENCE_ANSWER_S)
    if (newest := max(held, default=term)) > term:
        raise fenced_out(f"run {run_id}'s actors", newest, term)
    log.info(
        "run %s: %d of its %d actors now take their orders from this driver (term %d)",
        run_id,
        len(held),
        len(actors),
        term,
    )
    return term


def held_terms(actors: Sequence[Any], timeout_s: float) -> list[int]:
    """The terms the actors hold, of those that answer within `timeout_s`."""
    return answers_within([actor.term.remote() for actor in actors], timeout_s)
