"""The worker group's watchdogs (mixed into WorkerGroup): a worker hung, a replacement that never
started, and data that no longer reaches any worker. Each turns what it finds into a loss or an
error on the poll's status, and says in the log while a wait lasts.
"""

from __future__ import annotations

import logging
import time

import ray

from towerflow.errors import ClusterError
from towerflow.runtime.actors import kill_quietly
from towerflow.runtime.failure import ClusterStatus

log = logging.getLogger(__name__)


class WorkerWatchdogs:
    """For the WorkerGroup, which provides the slots, the timeouts, `_hang` and `_lose`."""

    def _find_hung(self, status: ClusterStatus) -> None:
        now = time.monotonic()
        for slot in self.slots.values():
            silent = now - slot.asked_at if slot.drain_ref is not None else 0.0
            if slot.answered and not slot.lost and not slot.finished and silent > self.timeout_s:
                self._hang(slot, status, f"no answer for {silent:.0f} s")

    def _find_unstarted(self, status: ClusterStatus) -> None:
        """A replacement that has not started (answered) within the start timeout: most often no
        node has room for it. It is withdrawn and counts as a loss; the policy decides what next."""
        now = time.monotonic()
        for slot in self.slots.values():
            waited = now - slot.replaced_at if slot.replaced_at is not None else 0.0
            if slot.answered or slot.lost:
                continue
            if waited > self.start_timeout_s:
                kill_quietly(slot.actor)
                self._lose(
                    slot,
                    status,
                    f"its replacement did not start within {waited:.0f} s: no node with room for it? "
                    f"(training.failure.start_timeout_s: {self.start_timeout_s:g})",
                )
            elif waited - slot.waiting_told_at >= self.tell_waiting_every_s:
                # A wait for room can last minutes: say so, rather than leave the log silent.
                slot.waiting_told_at = waited
                log.warning(
                    "worker %d's replacement has not started after %.0f s (%s; or still starting): "
                    "it counts as lost after %g s (training.failure.start_timeout_s)",
                    slot.worker_id,
                    waited,
                    _free_resources(),
                    self.start_timeout_s,
                )

    def _find_starved(self, status: ClusterStatus) -> None:
        """Every running worker waiting for its next batch: the data has stalled, which no new worker
        mends. Seen where a lost node's actors, placed again on the nodes left, took the CPUs that Ray
        Data's reads had (their tasks then wait for room, and the workers for them, for ever). The log
        says so as it lasts; after the start timeout the run fails, naming it."""
        live = [s for s in self.slots.values() if not s.lost and not s.finished]
        waits = [s.data_wait_s for s in live]
        if not live or not all(s.answered for s in live) or any(w is None for w in waits):
            self._starved_told_at = 0.0
            return
        starved = min(waits)
        if starved > self.start_timeout_s:
            status.stalled = ClusterError(
                f"no batch reached any worker for {starved:.0f} s ({_starved_advice()}): add a node, or "
                "resume (--resume) with a cluster.cpus_per_worker that leaves the reads room "
                f"(training.failure.start_timeout_s: {self.start_timeout_s:g})"
            )
        elif starved - self._starved_told_at >= self.tell_waiting_every_s:
            self._starved_told_at = starved
            log.warning(
                "no batch has reached any worker for %.0f s (%s): the run fails after %g s unless a "
                "node joins (training.failure.start_timeout_s)",
                starved,
                _starved_advice(),
                self.start_timeout_s,
            )


def _free_resources() -> str:
    free = ray.available_resources()
    parts = [f"{free.get('CPU', 0.0):g} CPU"] + ([f"{free['GPU']:g} GPU"] if free.get("GPU") else [])
    return f"the cluster has {' and '.join(parts)} free"


def _starved_advice() -> str:
    return (
        f"{_free_resources()}; Ray Data's read tasks wait for a free CPU, and a lost node's actors, "
        "placed again on the nodes left, may hold those the reads had"
    )
