"""The workers as one group: start them, poll them, replace one that is lost, stop them all.

A poll never raises for a lost worker. It drains every worker's step records without blocking on
any one of them, and returns what it found as a `ClusterStatus`: records, finished workers,
workers lost (their process or node died, or they hung: no answer, or one step for longer than
the timeout) and errors raised by the user's code, which are not the group's to retry. It raises
only where the workers answer to a newer driver (`FencedOut`, runtime/fencing.py): the run is no
longer this driver's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from towerflow.errors import FencedOut
from towerflow.runtime.actors import ACTOR_GONE, first_line, kill_quietly
from towerflow.runtime.failure import ActorLoss, ClusterStatus, LossKind
from towerflow.runtime.fencing import fenced_out
from towerflow.runtime.worker_watch import WorkerWatchdogs

log = logging.getLogger(__name__)
# A gap between two polls longer than this is the driver's own pause, not its workers' silence.
OWN_PAUSE_S = 1.0


@dataclass
class WorkerSlot:
    worker_id: int
    actor: Any
    run_ref: Any = None
    drain_ref: Any = None
    asked_at: float = 0.0  # when the pending drain was sent (monotonic)
    used_rows: int = 0  # examples of its split used by the workers under this id (every record's batch)
    lost: bool = False
    finished: bool = False
    answered: bool = False  # it has started (answered a drain): silence counts as a hang from then on
    replaced_at: float | None = None  # a replacement's start, until its first step: the time lost
    waiting_told_at: float = 0.0  # how long it had waited to start when the log last said so
    data_wait_s: float | None = None  # how long it had waited for its next batch at its last answer
    shard_error: str | None = None  # its run ended on a failed call to a shard: what Ray said
    runs: int = 0  # its runs started so far: the number of the current one
    stopped_run: int = 0  # the last run asked to stop


class WorkerGroup(WorkerWatchdogs):
    def __init__(
        self,
        make_actor: Callable[..., Any],
        timeout_s: float,
        start_timeout_s: float = 600.0,
        *,
        tell_waiting_every_s: float = 30.0,
    ) -> None:
        self._make_actor = make_actor  # (worker id, spare=False) -> a new worker actor
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s  # a replacement not started by then is lost in its turn
        self.tell_waiting_every_s = tell_waiting_every_s  # how often the log says one still waits
        self._starved_told_at = 0.0  # how long every worker had waited for data when the log said so
        self.slots: dict[int, WorkerSlot] = {}
        self.global_step = 0  # the newest step heard of, for naming when a loss happened
        self.recoveries_s: list[float] = []  # per replacement: loss noticed -> its first step
        self.spares: dict[
            int, tuple[Any, Any]
        ] = {}  # elastic: id -> (actor Ray may not have placed yet, its start or its warm-up)
        self._warmed: set[int] = set()  # spares asked to trace their step ahead
        self._next_id = 0
        self.replacements = 0  # new actors put in lost workers' places
        self.term = 0  # the driver's, which the workers' runs carry (runtime/fencing.py)
        self.newer_term: int | None = None  # a worker's, above the driver's: the run is another's now
        self._polled_at: float | None = None  # the last poll's end (monotonic)

    def start(self, worker_ids: list[int]) -> None:
        for worker_id in worker_ids:
            self.slots[worker_id] = WorkerSlot(worker_id, self._make_actor(worker_id))
            self._next_id = max(self._next_id, worker_id + 1)

    # -- elastic membership ----------------------------------------------------------------------
    def request_spare(self) -> int:
        """Ask Ray for one more worker under a new id; it starts when the cluster has room for it."""
        worker_id, self._next_id = self._next_id, self._next_id + 1
        actor = self._make_actor(worker_id, spare=True)
        self.spares[worker_id] = (actor, actor.devices_used.remote())
        return worker_id

    def ready_spares(self, warm_up: Callable[[Any], Any] | None = None) -> list[int]:
        """The spares that have started (placed, TensorFlow imported, model built) and, given
        `warm_up` (a spare's actor -> the ref of its `warm_up` call, or None: nothing to trace for
        yet), traced their step ahead. A spare that failed to start is dropped; one whose trace
        failed is ready all the same (it traces in its first step)."""
        ready = []
        for worker_id, (actor, pending) in list(self.spares.items()):
            if not ray.wait([pending], timeout=0)[0]:
                continue
            try:
                ray.get(pending)
            except ray.exceptions.RayError as exc:
                tracing_failed = worker_id in self._warmed and isinstance(exc, ray.exceptions.RayTaskError)
                if not tracing_failed:  # it never started, or its process is gone
                    log.warning("spare worker %d is lost before joining: %s", worker_id, first_line(exc))
                    del self.spares[worker_id]
                    continue
                log.info("spare worker %d could not trace its step ahead: %s", worker_id, first_line(exc))
            if warm_up is not None and worker_id not in self._warmed:
                tracing = warm_up(actor)
                if tracing is not None:
                    self._warmed.add(worker_id)
                    self.spares[worker_id] = (actor, tracing)
                    continue
            ready.append(worker_id)
        return ready

    def drop_spares(self, count: int) -> None:
        """Withdraw the newest `count` spare requests (none for a count of 0 or less: a negative
        slice would withdraw all but that many, spares the run still wants among them)."""
        for worker_id in sorted(self.spares)[::-1][: max(count, 0)]:
            actor, _ = self.spares.pop(worker_id)
            kill_quietly(actor)

    def take_over(self, worker_id: int, actor: Any, last_run: int) -> None:
        """A lost driver's worker, at rest, becomes a member under its id, as `start` makes one;
        its runs are numbered on from `last_run`."""
        self.slots[worker_id] = WorkerSlot(worker_id, actor, runs=last_run, stopped_run=last_run)
        self._next_id = max(self._next_id, worker_id + 1)

    def adopt(self, worker_id: int) -> None:
        """A started spare becomes a member (run it next)."""
        actor, _ = self.spares.pop(worker_id)
        self.slots[worker_id] = WorkerSlot(worker_id, actor, finished=True)

    def remove(self, worker_id: int) -> None:
        """Worker `worker_id` leaves the group for good (a shrink)."""
        slot = self.slots.pop(worker_id)
        kill_quietly(slot.actor)

    def stop_and_drain(
        self, timeout_s: float, on_lost: Callable[[list[int]], None] | None = None
    ) -> ClusterStatus:
        """Stop every worker after its current step and wait until each run has ended; returns all
        they reported meanwhile (their last steps, and any worker lost on the way, told at once to
        `on_lost`: sync survivors wait for a lost worker's gradient until the shards retire it).
        One still running after `timeout_s` is hung: killed, and reported lost."""
        self.request_stop()
        merged = ClusterStatus()
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            status = self.poll(0.2)
            if status.lost_workers and on_lost is not None:
                on_lost([loss.index for loss in status.lost_workers])
            merged.absorb(status)
        for worker_id in self.running:
            self._hang(self.slots[worker_id], merged, f"did not stop within {timeout_s:g} s")
        return merged

    @property
    def actors(self) -> list[Any]:
        """Every worker still alive, by id (finished ones included: hooks may still ask them)."""
        return [s.actor for _, s in sorted(self.slots.items()) if not s.lost]

    @property
    def running(self) -> list[int]:
        return [i for i, s in sorted(self.slots.items()) if not s.lost and not s.finished]

    @property
    def run_refs(self) -> list[Any]:
        return [s.run_ref for s in self.slots.values() if s.run_ref is not None and not s.finished]

    def run(self, worker_id: int, *args: Any) -> None:
        slot = self.slots[worker_id]
        slot.runs += 1
        slot.run_ref = slot.actor.run.remote(*args, run_number=slot.runs, term=self.term)

    def request_stop(self) -> None:
        """Ask every live worker's current run to stop after its step; a run asked already is not
        asked again, so a caller may ask every turn and reach the runs started since."""
        for slot in self.slots.values():
            if not slot.lost and slot.stopped_run != slot.runs:
                slot.stopped_run = slot.runs
                slot.actor.request_stop.remote(slot.runs)

    def replace(self, worker_id: int, *run_args: Any, actor: Any = None) -> None:
        """A new actor (or `actor`, a warm spare that took the id) under a lost worker's id, running
        with `run_args` (its split taken over)."""
        lost = self.slots[worker_id]
        actor = actor if actor is not None else self._make_actor(worker_id)
        slot = WorkerSlot(worker_id, actor, used_rows=lost.used_rows)
        self._next_id = max(self._next_id, worker_id + 1)
        slot.replaced_at = time.monotonic()
        self.replacements += 1
        self.slots[worker_id] = slot
        self.run(worker_id, *run_args)

    def poll(self, wait_s: float, answer_s: float = 1.0) -> ClusterStatus:
        """Wait up to `wait_s` (less when every run ends), then drain every worker, giving each up
        to `answer_s` to answer: one that does not keeps its question open and counts as silent
        from then on. A replacement still starting holds each turn for `answer_s` too: not waiting
        for it hears of steps sooner but measured slower training (docs/reliability.md)."""
        status = ClusterStatus()
        self._excuse_own_pause()
        runs = [
            s.run_ref for s in self.slots.values() if s.run_ref is not None and not s.finished and not s.lost
        ]
        if runs:
            ray.wait(runs, num_returns=len(runs), timeout=wait_s)
        now = time.monotonic()
        live = [s for s in self.slots.values() if not s.lost and not s.finished]
        for slot in live:
            if slot.drain_ref is None:
                slot.drain_ref, slot.asked_at = slot.actor.drain.remote(), now
        pending = [s.drain_ref for s in live]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=answer_s)
        for slot in live:
            self._read_drain(slot, status, block=False)
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0) if runs else ([], [])
        for slot in [s for s in self.slots.values() if s.run_ref in done]:
            self._read_run(slot, status)
        self._polled_at = time.monotonic()
        if self.newer_term is not None:  # not this driver's to judge, nor to wait for: it stops
            raise fenced_out("its workers", self.newer_term, self.term)
        self._find_hung(status)
        self._find_unstarted(status)
        self._find_starved(status)
        for record in status.records:
            self.global_step = max(self.global_step, record.step)
            slot = self.slots[record.worker]
            slot.used_rows += record.examples
            if slot.replaced_at is not None:
                self.recoveries_s.append(time.monotonic() - slot.replaced_at)
                slot.replaced_at = None
        return status

    def wait_ended(self, timeout_s: float) -> list[ActorLoss]:
        """Wait until every worker's run has ended (the shards were finished), dropping the steps
        they report; one still running after `timeout_s` is killed, to be replaced. Returns the
        workers lost meanwhile (a shard's node lost with more than one worker: the poll that found
        the shard's loss may not have found them all) and those killed, to be counted and told."""
        deadline = time.monotonic() + timeout_s
        lost = ClusterStatus()
        while self.running and time.monotonic() < deadline:
            lost.losses += [loss for loss in self.poll(0.2).losses if loss.kind is LossKind.WORKER]
        for worker_id in self.running:
            slot = self.slots[worker_id]
            kill_quietly(slot.actor)
            self._lose(
                slot, lost, f"its run did not end within {timeout_s:g} s of the rollback: killed", hung=True
            )
        return lost.losses

    def rerun(self, worker_id: int, *run_args: Any, actor: Any = None) -> None:
        """Run worker `worker_id` again from a fresh data split (a rollback); a lost one is replaced
        (by `actor`, a warm spare that took its id, when given)."""
        slot = self.slots[worker_id]
        slot.used_rows = 0
        if slot.lost:
            self.replace(worker_id, *run_args, actor=actor)
            return
        slot.finished, slot.drain_ref, slot.shard_error = False, None, None
        self.run(worker_id, *run_args)

    def let_silent_go(self, silent_for_s: float) -> list[ActorLoss]:
        """Once the run's last step is taken, running workers have nothing left to do. One still
        starting (a replacement) is let go at once; one silent for `silent_for_s` (hung) too, rather
        than waited for up to `timeout_s` and replaced. Returns the hung ones, for the record."""
        now, hung = time.monotonic(), ClusterStatus()
        for slot in self.slots.values():
            silent = now - slot.asked_at if slot.drain_ref is not None else 0.0
            if slot.lost or slot.finished or (slot.answered and silent <= silent_for_s):
                continue
            kill_quietly(slot.actor)
            if slot.answered:
                self._lose(
                    slot, hung, f"no answer for {silent:.0f} s, with the run's last step taken", hung=True
                )
            else:
                log.info("worker %d had not started by the run's last step: let go", slot.worker_id)
                slot.lost, slot.drain_ref = True, None
        return hung.losses

    def lose_stranded(self, status: ClusterStatus) -> None:
        """Workers whose run ended on a failed call to a shard when every shard answers after all
        (a call lost in transit: Ray's ActorUnavailableError, say) count as lost, to be replaced
        with their split's unread rows; finished, they would leave their data unread and the run a
        worker short for good."""
        for slot in self.slots.values():
            if slot.finished and not slot.lost and slot.shard_error is not None:
                kill_quietly(slot.actor)  # alive and idle: its replacement takes its id
                cause = f"its call to a parameter server failed, and every one answers: {slot.shard_error}"
                self._lose(slot, status, cause)

    def kill(self) -> None:
        actors = [slot.actor for slot in self.slots.values()] + [actor for actor, _ in self.spares.values()]
        for actor in actors:
            kill_quietly(actor)

    # -- internals -------------------------------------------------------------------------------
    def _read_drain(self, slot: WorkerSlot, status: ClusterStatus, *, block: bool) -> None:
        ref = slot.drain_ref
        if ref is None or (not block and not ray.wait([ref], timeout=0)[0]):
            return
        slot.drain_ref = None
        try:
            report = ray.get(ref)
        except ACTOR_GONE as exc:
            self._lose(slot, status, first_line(exc))
            return
        slot.answered = True
        slot.data_wait_s = report.data_wait_s
        if report.term > self.term:  # another driver's worker now: not this one's to judge (the poll stops)
            self._note_term(report.term)
            return
        status.records.extend(report.records)
        if report.busy_s is not None and report.busy_s > self.timeout_s:
            self._hang(slot, status, f"one step has taken {report.busy_s:.0f} s")

    def _read_run(self, slot: WorkerSlot, status: ClusterStatus) -> None:
        try:
            summary = ray.get(slot.run_ref)
        except (
            ray.exceptions.RayTaskError
        ) as exc:  # raised in `run` (Ray makes it an instance of the cause too)
            if isinstance(exc.cause, FencedOut):  # refused: the worker is a newer driver's
                self._note_term(exc.cause.term or self.term + 1)
                return
            # A shard it talked to is gone, or the parameters it published (their owner): the shards' loss
            if isinstance(exc.cause, (*ACTOR_GONE, ray.exceptions.ObjectLostError)):
                slot.finished, slot.shard_error = True, first_line(exc.cause)
                status.finished[slot.worker_id] = {"worker": slot.worker_id, "failed": first_line(exc)}
                status.shard_trouble = True
                return
            status.user_error = exc
            return
        except ACTOR_GONE as exc:  # the worker itself is gone
            self._lose(slot, status, first_line(exc))
            return
        # Its last records were appended before `run` returned: drain them now.
        if slot.drain_ref is None:
            slot.drain_ref = slot.actor.drain.remote()
        self._read_drain(slot, status, block=True)
        slot.finished = True
        status.finished[slot.worker_id] = summary

    def _note_term(self, term: int) -> None:
        if term > self.term:
            self.newer_term = max(term, self.newer_term or 0)

    def _excuse_own_pause(self) -> None:
        """A driver that did not poll for a while (its process paused, starved of CPU, or in a
        long hook) was not listening: the questions it had sent count that long less, so that
        its workers' silence is not taken for a hang (and the workers, perhaps another driver's
        by now, for lost) as it wakes."""
        now = time.monotonic()
        gap = now - self._polled_at if self._polled_at is not None else 0.0
        if gap <= OWN_PAUSE_S:
            return
        for slot in self.slots.values():
            if slot.drain_ref is not None:
                slot.asked_at = min(now, slot.asked_at + gap)
        if gap > self.timeout_s:
            log.warning(
                "the driver did not poll its workers for %.0f s (its process paused, or starved of "
                "CPU): their silence meanwhile is not counted",
                gap,
            )

    def _hang(self, slot: WorkerSlot, status: ClusterStatus, why: str) -> None:
        kill_quietly(slot.actor)  # alive but stuck: a fresh one does better
        self._lose(slot, status, f"{why} (training.failure.worker_timeout_s: {self.timeout_s:g})", hung=True)

    def _lose(self, slot: WorkerSlot, status: ClusterStatus, cause: str, *, hung: bool = False) -> None:
        if slot.lost:
            return
        slot.lost, slot.drain_ref = True, None
        status.losses.append(ActorLoss(LossKind.WORKER, slot.worker_id, self.global_step, cause, hung=hung))
