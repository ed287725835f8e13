"""What the controller does when the cluster changes under a run: replace lost workers, roll the
shards back after a lost parameter server, and resize an elastic run. The driver (runtime/driver.py)
mixes these in; it owns the loop, the hooks and the run's state."""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from towerflow.errors import DataError, TrainingError
from towerflow.runtime.actors import ACTOR_GONE, answers_within
from towerflow.runtime.events import StepAggregator
from towerflow.runtime.failure import ActorLoss, Decision, LossKind
from towerflow.runtime.hooks import FaultEvent
from towerflow.runtime.placement import DECLARED_DEAD_WAIT_S, declared_dead
from towerflow.runtime.worker_messages import Rejoin

log = logging.getLogger(__name__)
# A rollback's wait for the live shards' answers to its `finish` (a newer driver's refusal among them).
FINISH_ANSWER_S = 5.0


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHING = "finishing"
    FINISHED = "finished"
    ERRORED = "errored"


@dataclass(frozen=True)
class PendingReplacement:
    """A lost worker's replacement not started yet: what it will run, and when the worker was lost."""

    run_args: tuple[Any, ...]
    since: float


class RecoveryActions:
    """The controller's actions on lost actors and resizes (a mixin of the Driver, whose state they use)."""

    def _membership_change(self) -> tuple[list[int], list[int]] | None:
        """Workers to let go and started spares to take in, toward the elastic target; None: no change.
        Not once a worker has finished (its data ended: the run is ending) or a stop was asked for."""
        group = self.group
        if self.context.stop_requested or any(s.finished or s.lost for s in group.slots.values()):
            return None
        wanted = self.control.new_worker_count() if self.control is not None else None
        if wanted is not None:
            log.info("towerflow scale: %d worker(s) wanted, %d running", wanted, len(group.running))
            self.elastic.scale_to(wanted)
        # Workers on a draining node count as gone already: spares are asked for in their places.
        going = self.drain_watch.draining_workers & set(group.running)
        wanted = self.elastic.spares_wanted(len(group.running) - len(going), len(group.spares))
        group.drop_spares(-wanted)
        for _ in range(wanted):
            group.request_spare()
        return self.elastic.resize(group.running, group.ready_spares(self._warm_up_spare), going)

    def _warm_up_spare(self, actor: Any) -> Any:
        """Have a started spare trace its step for the members' batches while they train on (the
        ref of the call), or None when no member has had a batch yet."""
        if self._warm_up_info is None:
            for worker_id in self.group.running:
                with contextlib.suppress(ray.exceptions.RayError):
                    info = ray.get(self.group.slots[worker_id].actor.warm_up_info.remote(), timeout=10)
                    if info is not None:
                        self._warm_up_info = info
                        break
        if self._warm_up_info is None:
            return None
        return actor.warm_up.remote(self._placement(), self.shard_group.buckets, self._warm_up_info)

    def _resize(self, *, leaving: list[int], joining: list[int], records: list[Any]) -> None:
        """Stop every worker between steps, take in `joining`, let `leaving` (and any lost) go, and
        start the new set on data re-planned from the position reached. The shards keep their state
        and version; no actor restarts but those that leave."""
        self.state = State.RESIZING
        before, started = len(self.group.slots), time.monotonic()
        self._drop_pending_replacements()  # the lost are let go or replaced below
        self._close_data()  # a worker waiting at an epoch barrier for a lost split's consumer goes on
        # Sync survivors wait for a lost worker's gradient: the shards step without it first.
        self._retire([i for i, slot in self.group.slots.items() if slot.lost])
        status = self.group.stop_and_drain(timeout_s=self.group.timeout_s, on_lost=self._retire)
        if status.fatal is not None:
            raise status.fatal
        if self.failure_policy.decide(status) is Decision.FAIL:
            raise TrainingError(self.failure_policy.failure_message())
        self._summaries.update(status.finished)
        drained_s = time.monotonic() - started
        drained = sorted(self._backlog + records + status.records, key=lambda r: (r.step, r.finished_at))
        self._backlog = []
        self._ready_events += self.aggregator.add(drained) + self.aggregator.flush()
        lost = [i for i, slot in self.group.slots.items() if slot.lost and i not in leaving]  # leaving anyway
        keep_lost = max(
            0, self.elastic.fewest - (len(self.group.slots) - len(lost) - len(leaving) + len(joining))
        )
        for worker_id in leaving + lost[keep_lost:]:  # the lost beyond min go; those under it are replaced
            self.group.remove(worker_id)
        for worker_id in joining:
            self.group.adopt(worker_id)
            self._start_steps[worker_id] = 0
        members = sorted(self.group.slots)
        version = ray.get(self.shards[0].ping.remote())
        replicas = self.elastic.replicas_to_aggregate(len(members))
        planned = time.monotonic()
        try:
            feed = self.make_data(len(members), self.aggregator.examples_seen, self._step_shape(len(members)))
        except DataError as exc:  # nothing left to read: the run ends here
            log.info("resize at step %d: %s", version, exc)
            for slot in self.group.slots.values():
                slot.finished = True
            self.state = State.RUNNING
            return
        planned_s = time.monotonic() - planned
        self._count_from(feed)
        seen = self.aggregator.examples_seen
        ray.get([shard.resize.remote(len(members), replicas, seen, term=self.term) for shard in self.shards])
        self._note_data_end(version, feed)
        self.data_splits = dict(zip(members, feed.splits))
        self._set_worker_count(len(members))
        model_state = self.model_state()
        for worker_id in members:
            self.group.rerun(
                worker_id,
                self.shards,
                self._placement(),
                self.shard_group.buckets,
                self.data_splits[worker_id],
                Rejoin([], model_state),
            )
        log.warning(
            "resized from %d to %d worker(s) at step %d (workers stopped in %.1f s, data planned in %.1f s, "
            "%.1f s in all)",
            before,
            len(members),
            version,
            drained_s,
            planned_s,
            time.monotonic() - started,
        )
        self.session.log_metrics({"workers": float(len(members))}, version)
        self.state = State.RUNNING

    def _retire(self, worker_ids: list[int]) -> None:
        """Every shard stops waiting for these (lost) workers' gradients: sync steps aggregate without
        them. The steps their gradients went into stop waiting for their records, which will not
        come (lost between a push and its record, they would hold every later step's report, hooks
        and checkpoints for the aggregator's grace). A shard lost meanwhile (with them, on their
        node) is not waited for: the workers' calls to it fail, and the next turn rolls back."""
        refs = [shard.retire.remote(worker_id) for shard in self.shards for worker_id in worker_ids]
        for ref in refs:
            with contextlib.suppress(*ACTOR_GONE):
                ray.get(ref)
        with contextlib.suppress(*ACTOR_GONE):  # the lead shard, whose replies name the steps
            step_workers = ray.get(self.shards[0].step_workers.remote(self.aggregator.last_emitted))
            self.aggregator.write_off(set(worker_ids), step_workers)

    def _close_data(self, wait_s: float = 0.0, *, release: bool = False) -> None:
        """End the workers' streams; wait up to `wait_s` for their reading to stop. `release`: the
        run is over, and the data's coordinator goes too."""
        for split in list(self.data_splits.values())[:1]:  # one coordinator serves every split
            if hasattr(split, "close"):
                closed = split.close()
                if wait_s and closed is not None:
                    ray.wait([closed], timeout=wait_s)
            if release and hasattr(split, "shut_down"):
                split.shut_down()

    def _log_losses(self) -> None:
        lost = self.failure_policy.lost(LossKind.WORKER)
        replaced = self.group.replacements
        self.session.log_metrics(
            {"workers_lost": float(lost), "workers_replaced": float(replaced)}, self._global_step()
        )

    def _replace_workers(self, losses: list[ActorLoss]) -> None:
        """Each lost worker's steps go on without it at once (the shards retire it); a warm spare
        (`cluster.spare_workers`) takes its id, its split and its unused rows now, a new actor once
        Ray can place one (`_replace_pending`), and joins the steps when it has started."""
        self._retire([loss.index for loss in losses])
        model_state = self.model_state()
        # The chief hears of steps a poll late; the shard counted every gradient the worker sent.
        try:
            taken = ray.get(self.shards[-1].examples_taken.remote())
        except ACTOR_GONE:  # lost with the workers: the rollback the next turn makes re-plans the data
            taken = {}
        for loss in losses:
            split, heard = self.data_splits[loss.index], self.group.slots[loss.index].used_rows
            used = max(heard, taken.get(loss.index, 0))
            leftover = split.leftover(used) if hasattr(split, "leftover") else []
            handed_over = used + sum(piece.rows for piece in leftover)
            rest = split.taken_over(handed_over) if hasattr(split, "taken_over") else split
            run_args = (rest, Rejoin(leftover, model_state))
            spare = self._take_spare_worker(loss.index)
            if spare is not None:
                self._replace(loss.index, run_args, spare)
            else:
                self._pending_replacements[loss.index] = PendingReplacement(run_args, time.monotonic())
            self._fault(loss, "replaced by a warm spare" if spare is not None else "replaced")
        self._log_losses()

    def _replace(self, worker_id: int, run_args: tuple[Any, ...], actor: Any = None) -> None:
        self.group.replace(
            worker_id, self.shards, self._placement(), self.shard_group.buckets, *run_args, actor=actor
        )

    def _replace_pending(self) -> None:
        """Start the lost workers' new actors that Ray can place now. Placing one needs the GCS: not
        before it has answered since the loss (a node lost with the head waits for the head's
        return, while the others train on), nor before Ray has declared the lost one dead, where
        it held a bundle (its node's health checks: until then the bundle points at the lost node)."""
        for worker_id, pending in list(self._pending_replacements.items()):
            if not self.gcs_answers.answered_after(pending.since):
                continue
            waited = time.monotonic() - pending.since
            lost = self.group.slots[worker_id].actor
            if self.actor_placement.holds_worker(worker_id) and not declared_dead(lost):
                if waited < DECLARED_DEAD_WAIT_S:
                    continue
                log.warning(
                    "Ray has not declared worker %d dead after %.0f s; replacing it anyway", worker_id, waited
                )
            del self._pending_replacements[worker_id]
            self._replace(worker_id, pending.run_args)
            self._log_losses()  # workers_replaced

    def _drop_pending_replacements(self) -> list[int]:
        """Forget the replacements not started yet (their workers stay lost); returns their ids."""
        dropped = sorted(self._pending_replacements)
        self._pending_replacements.clear()
        return dropped

    def _roll_back(self, losses: list[ActorLoss], lost_workers: Sequence[ActorLoss] = ()) -> None:
        """A shard is lost: every shard goes back to the newest checkpoint together (never a mix of
        versions), a warm spare or a new shard takes each lost one's place, and the workers train
        on from there, on the data from that checkpoint's position. Workers and the other shards
        are not restarted, but for `lost_workers` (lost with the shard, on its node most often),
        which warm spares (`cluster.spare_workers`) or new actors replace."""
        started = time.monotonic()
        heard = max(self.group.global_step, self._global_step())
        self._close_data()
        lost = [loss.index for loss in losses]
        finishing = self.shard_group.finish()  # release every worker waiting on a live shard; each run ends
        self.group.request_stop()  # and every worker waiting for data
        ended_lost = self.group.wait_ended(timeout_s=60)  # lost meanwhile: replaced with the others
        if ended_lost:
            self.failure_policy.record(ended_lost)
            if self.failure_policy.over_budget():
                raise TrainingError(self.failure_policy.failure_message())
            lost_workers = [*lost_workers, *ended_lost]
        # The live shards' answers (a lost one's may not come while the GCS is away): a newer
        # driver's refusal (`FencedOut`) stops this one here, before it picks a rollback point.
        live = [ref for index, ref in enumerate(finishing) if index not in lost]
        answers_within(live, FINISH_ANSWER_S, ACTOR_GONE)
        state, source = self._rollback_point(lost)
        version = state.global_step if state is not None else 0
        by_spare = self.shard_group.replace(lost)
        seen = state.examples_seen if state is not None else 0
        members = sorted(self.group.slots)
        feed = self.make_data(len(members), seen, self._step_shape(len(members)))
        self.data_splits = dict(zip(members, feed.splits))
        self._note_data_end(version, feed)  # a file partly read before the checkpoint is read again
        self.aggregator = StepAggregator(
            replicas_per_step=self.aggregator.replicas_per_step, first_step=version + 1, examples_seen=seen
        )
        self._count_from(feed)
        self._backlog = []  # records of the steps rolled back, heard while a hook waited: redone
        self._load_shards(state, version, rollback=True)  # from the data position the feed starts at
        self.aggregator.start()
        model_state = state.model_state if state is not None else {}
        # Those lost before, whose replacements wait for Ray, are replaced with them.
        lost_ids = [loss.index for loss in lost_workers] + self._drop_pending_replacements()
        spares = {worker_id: self._replacement_for(worker_id) for worker_id in lost_ids}  # or None
        for worker_id, split in self.data_splits.items():
            rejoin = Rejoin([], model_state)
            self.group.rerun(
                worker_id,
                self.shards,
                self._placement(),
                self.shard_group.buckets,
                split,
                rejoin,
                actor=spares.get(worker_id),
            )
        redo = max(0, heard - version)
        self.group.global_step = version  # the furthest step heard is the rolled-back timeline's no more
        self._rollbacks += 1
        self._steps_redone += redo
        metrics = {
            "ps_rollbacks": float(self._rollbacks),
            "steps_redone": float(self._steps_redone),
            "ps_rollback_s": time.monotonic() - started,  # the loss found to the workers training again
        }
        self.session.log_metrics(metrics, version)
        for loss in losses:
            taken = ", a warm spare in its place" if loss.index in by_spare else ""
            self._fault(loss, f"rolled back to step {version} ({source}), {redo} step(s) to redo{taken}")
        for loss in lost_workers:
            how = "replaced by a warm spare" if spares[loss.index] is not None else "replaced"
            self._fault(loss, f"{how}, in the rollback")
        if lost_workers:
            self._log_losses()

    def _rollback_point(self, lost: list[int]) -> tuple[Any, str]:
        """The newest state every shard can go back to after losing shards `lost`, and what it is:
        the newest memory checkpoint where a live peer holds each lost shard's part, or the newest
        stored checkpoint, or the state the run started from."""
        stored = self.latest_checkpoint() if self.latest_checkpoint is not None else None
        source = "the stored checkpoint" if stored is not None else "the run's start"
        stored = stored or self._stored_start()
        memory = self.memory_checkpoints.latest
        self.memory_checkpoints.forget()  # whichever is taken, what the shards kept is left behind
        if memory is None:
            return stored, source
        if not memory.restores(lost, lambda holder: self.shard_group.holder_lives(holder, lost)):
            log.warning(
                "shards %s lost with the peers holding their copies: back to %s, not to the memory "
                "checkpoint of step %d",
                lost,
                source,
                memory.global_step,
            )
            return stored, source
        if stored is not None and stored.global_step >= memory.global_step:
            return stored, source
        return memory, "a memory checkpoint"

    def _lost_shards(self) -> list[ActorLoss]:
        """The shards lost. Those that did not answer while the GCS was silent are not judged:
        `_shards_unsettled` has the next turn look again (shard_group.py, `ShardGroup.look`)."""
        look = self.shard_group.look(self._global_step(), self.gcs_answers.answered_after)
        if look.unanswered and not self._shards_unsettled:
            log.info(
                "shard(s) %s not answering while the cluster's head is silent: asked again", look.unanswered
            )
        self._shards_unsettled = bool(look.unanswered)
        return look.lost

    def _fault(self, loss: ActorLoss, action: str) -> None:
        self._tell_fault(FaultEvent(loss.at_step, loss.describe(), action))

    def _tell_fault(self, event: FaultEvent) -> None:
        log.warning("%s: %s", event.what, event.action)
        for hook in self.hooks:
            hook.on_fault(event)
