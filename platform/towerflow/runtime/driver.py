"""The driver (chief, controller): creates the shards and workers, hears of every step, runs the
hooks, and keeps the run going when training actors are lost.

It never relays tensors: workers pull parameters from and push gradients to the shards directly.
As Ray Train v2's controller, it loops over explicit states; each turn polls the workers for their
status as data (runtime/worker_group.py), lets the failure policy decide (runtime/failure.py), and
acts: report steps to the hooks, replace lost workers, or fail. Whatever happens, every hook's
`end` is called and the actors are released.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from towerflow.errors import TrainingError
from towerflow.runtime.actor_pool import IdleActors, ReuseKey, free_for_the_next_run
from towerflow.runtime.checkpointing import CheckpointActions
from towerflow.runtime.draining import LOOK_EVERY_S, DrainWatch, ray_draining_nodes
from towerflow.runtime.elastic import ElasticPolicy, workers_that_fit
from towerflow.runtime.events import StepAggregator, past_step_events
from towerflow.runtime.failure import Decision, FailurePolicy
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.head_watch import BackgroundAnswer, HeadWatch
from towerflow.runtime.hook_queries import HookQueries
from towerflow.runtime.hooks import FaultEvent, Hook, RunContext, RunOutcome, SessionInfo, end_hooks
from towerflow.runtime.memory_checkpoints import MemoryCheckpoints
from towerflow.runtime.placement import ActorPlacement
from towerflow.runtime.protocol import protocol_for, step_shape
from towerflow.runtime.recovery import PendingReplacement, RecoveryActions, State
from towerflow.runtime.result import TrainResult
from towerflow.runtime.run_actors import RunActors
from towerflow.runtime.run_control import ControlPoint
from towerflow.runtime.run_end import RunEnd
from towerflow.runtime.run_keeper import LiveRun
from towerflow.runtime.run_ownership import RunOwnership
from towerflow.runtime.shard_group import ShardGroup
from towerflow.runtime.signals import StopRequested, StopSignals
from towerflow.runtime.spares import SparePool
from towerflow.runtime.user_errors import as_user_error, check_model
from towerflow.runtime.worker_group import WorkerGroup
from towerflow.shared_types import DataFeed, StepShape

log = logging.getLogger(__name__)
# Once the last step is taken, a worker silent this long (or its timeout, if shorter) is let go: a
# live one answers a drain within a poll, even mid-step (a drain runs on a thread of its own).
SILENT_AT_THE_END_S = 15.0
LET_GO = "let go, not replaced: {}"
LAST_STEP_TAKEN = "the run's last step was taken"


class Driver(RunActors, RecoveryActions, CheckpointActions, HookQueries, RunEnd, RunOwnership):
    def __init__(
        self,
        spec: Any,
        hooks: Sequence[Hook],
        make_data: Callable[..., DataFeed],
        *,
        faults: FaultInjector | None = None,
        poll_s: float = 0.2,
        return_parameters: bool = True,
        initial_state: Any = None,
        latest_checkpoint: Callable[[], Any] | None = None,
    ) -> None:
        self.spec = spec
        self.hooks = list(hooks)
        self.make_data = make_data  # called after hooks begin, so bad data still ends a tracked run
        self.data_splits: dict[int, Any] = {}  # worker id -> its stream
        self.feature_scales: dict[str, float] = {}
        self.faults = faults
        failure = spec.training.failure
        self.failure_policy = FailurePolicy(failure.max_worker_failures, failure.max_ps_failures)
        self.group = WorkerGroup(self._new_worker, failure.worker_timeout_s, failure.start_timeout_s)
        self.protocol = protocol_for(spec.training.mode)  # asked what differs between sync and async
        self.actor_placement = ActorPlacement(spec.cluster, f"towerflow-{spec.name}-{uuid.uuid4().hex[:8]}")
        self.shard_group = ShardGroup(spec, self._apply_threads(), self.actor_placement)
        # The term the run's actors take this driver's orders under: above its earlier drivers'
        # where it took the run over (runtime/fencing.py).
        self.term = initial_state.term if isinstance(initial_state, LiveRun) else 0
        self.group.term = self.shard_group.term = self.term
        self.memory_checkpoints = MemoryCheckpoints(
            failure.memory_checkpoint_every_s, failure.memory_checkpoint_draining_s
        )
        # The GCS is asked off the loop, which a lost head's restart must not hold up (head_watch.py).
        self.gcs_answers = BackgroundAnswer(ray_draining_nodes, LOOK_EVERY_S, "towerflow-gcs-watch")
        self.drain_watch = DrainWatch(self.gcs_answers)  # nodes holding shards that are about to go
        self.head_watch = HeadWatch(self.gcs_answers)
        # cluster.spare_workers; a worker's start also builds the model (and, on a GPU, sets it up)
        self.worker_spares = SparePool(self._new_spare_worker, "worker", answer_timeout_s=30.0)
        self.elastic = ElasticPolicy.for_spec(spec)
        self.control: ControlPoint | None = None  # where `towerflow scale` leaves a worker count
        # A kept run's shards and spares, as its control point knows them (runtime/run_keeper.py).
        self._handed_over: tuple[Any, ...] = ()
        self._warm_up_info: Any = None  # a member's batch signature, for spares to trace ahead
        # node id -> the ref of readying it for the read tasks (a spare's node, as the spare starts)
        self._ready_node_for_reading: Callable[[str], Any] | None = None
        self.state = State.STARTING
        self._backlog: list[Any] = []  # records drained while a hook waited (capture_state), to report
        self._ready_events: list[Any] = []  # steps completed by a resize's drain, to report
        self._summaries: dict[int, dict[str, Any]] = {}  # worker id -> its run's summary
        # lost worker id -> its new actor's run, until Ray can place it (recovery.py)
        self._pending_replacements: dict[int, PendingReplacement] = {}
        self._shards_unsettled = False  # some did not answer the last look, the GCS silent: look again
        self._idle: IdleActors | None = None  # the last run's actors, which this run takes (actor_pool.py)
        self._reuse: ReuseKey | None = None  # what this run's actors are made for, once known (`_reuse_key`)
        self._rollbacks = self._steps_redone = 0
        self.poll_s = poll_s
        self.return_parameters = return_parameters
        self.initial_state = initial_state  # a TrainingState to resume from
        self.latest_checkpoint = latest_checkpoint  # () -> the run's newest TrainingState, or None
        self.session = SessionInfo(
            spec=spec,
            num_workers=spec.cluster.workers,
            num_shards=spec.cluster.ps,
            start_step=initial_state.global_step if initial_state is not None else 0,
            resumed_from=_resumed_from(initial_state),
            runtime=self,
        )
        self.session._metric_listeners = self.hooks
        self.context = RunContext(self.session)
        self.stop_signals = StopSignals()
        self._start_steps: dict[int, int] = {}  # worker id -> the global step it waits for before its first
        self._evaluator: Any = None
        self._final_model_state: dict[str, np.ndarray] | None = None  # read once the training is over
        self._model_has_state: bool | None = None  # known from the first answer of the workers
        self.aggregator = StepAggregator(
            replicas_per_step=self._step_shape(spec.cluster.workers).batches_per_update,
            first_step=self.session.start_step + 1,
            examples_seen=initial_state.examples_seen if initial_state is not None else 0,
        )

    def run(self) -> TrainResult:
        with self.stop_signals:  # SIGTERM and Ctrl-C stop the run where it checks, between steps
            return self._run()

    def _run(self) -> TrainResult:
        started = time.time()
        begun: list[Hook] = []
        outcome = RunOutcome("FAILED", 0)
        try:
            for hook in self.hooks:
                hook.begin(self.session)
                begun.append(hook)
            self._report_past_steps()
            self.stop_signals.check()
            check_model(self.spec.model)
            count = self._starting_workers()
            feed = self.make_data(count, None, self._step_shape(count))
            self._count_from(feed)
            self.data_splits, self.feature_scales = dict(enumerate(feed.splits)), feed.feature_scales
            self._ready_node_for_reading = feed.ready_node_for_reading
            self._note_data_end(self.session.start_step, feed)
            self._idle = self._take_idle_actors()  # first: the control point names their placement groups
            self.control = self._control_point()
            self._create_actors(count)
            for hook in self.hooks:
                hook.after_create_session(self.session)
            worker_summaries = self._train()
            self.stop_signals.check()  # a stop signal ended the training: the run ends KILLED
            self._check_something_trained()
            result = self._result(worker_summaries, started)
            outcome = RunOutcome("FINISHED", result.global_step, result=result)
            return result
        except KeyboardInterrupt as exc:
            between_steps = isinstance(exc, StopRequested) and bool(self.shards)
            outcome = RunOutcome("KILLED", self._global_step(), exc, stopped_between_steps=between_steps)
            raise
        except BaseException as exc:
            taken = self._taken_over(exc)  # woken to find its actors another driver's: it fails as that
            if taken is not None:
                outcome = RunOutcome("TAKEN_OVER", self._global_step(), taken)
                if taken is exc:
                    raise
                raise taken from exc
            error = as_user_error(exc)  # the run's error tag shows the user's message, not Ray's wrapper
            outcome = RunOutcome("FAILED", self._global_step(), error)
            raise error from exc
        finally:
            try:
                failed_at_end = end_hooks(begun, self.session, outcome)
            finally:
                self._release(outcome)
            if failed_at_end is not None:
                raise failed_at_end

    # -- set-up ----------------------------------------------------------------------------------
    def _report_past_steps(self) -> None:
        """A taken-over run's last steps, as its kept workers recorded them, to the hooks: the lost
        driver may not have logged them, or was gone when they were taken."""
        if isinstance(self.initial_state, LiveRun):
            state = self.initial_state
            events = past_step_events(state.recent_records(), state.examples_seen)
            if events:
                for hook in self.hooks:
                    hook.on_past_steps(events)

    def _starting_workers(self) -> int:
        """All of cluster.workers; elastic, as many as the cluster has room for now (at least min)."""
        if not self.elastic.elastic:
            return self.spec.cluster.workers
        room = workers_that_fit(self.spec.cluster, free_for_the_next_run())
        count = self.elastic.start_count(room)
        log.info(
            "elastic: starting with %d worker(s) (room for %d, min %d, max %d)",
            count,
            room,
            self.elastic.fewest,
            self.elastic.most,
        )
        self._set_worker_count(count)
        return count

    def _control_point(self) -> ControlPoint | None:
        """The run's control point (a tracked run's): made here, or a lost driver's, taken over
        with its shards; a kept run's lives beyond this driver (runtime/run_keeper.py)."""
        run_id = self.session.tags.get("run_id")
        if isinstance(self.initial_state, LiveRun):
            return self.initial_state.control  # renewing since the take-over
        if not run_id:
            return None
        if not self._kept_beyond_the_driver():
            return ControlPoint(run_id)
        grace_s = self.spec.training.failure.driver_grace_s
        return ControlPoint(run_id, grace_s=grace_s, group_names=self.actor_placement.group_names())

    def _set_worker_count(self, count: int) -> None:
        self.session.num_workers = count
        self.aggregator.replicas_per_step = self._step_shape(count).batches_per_update

    def _step_shape(self, workers: int) -> StepShape:
        return step_shape(self.spec.training.mode, self.elastic.replicas_to_aggregate(workers))

    # -- the loop --------------------------------------------------------------------------------
    def _train(self) -> list[dict[str, Any]]:
        self.aggregator.start()
        for worker_id, split in self.data_splits.items():
            self.group.run(worker_id, self.shards, self._placement(), self.shard_group.buckets, split)
        self.state = State.RUNNING
        stopping = released = False
        while self.state is State.RUNNING:
            fresh = self._turn()
            records, self._backlog = self._backlog + fresh, []
            records.sort(key=lambda r: (r.step, r.finished_at))
            events, self._ready_events = self._ready_events + self.aggregator.add(records), []
            self._report(events)
            if self.stop_signals.received is not None and not stopping:
                log.warning(
                    "%s: stopping after the steps in flight (send it again to stop at once)",
                    self.stop_signals.name,
                )
                self.context.request_stop(f"stopped by {self.stop_signals.name}")
            self._watch_head()
            if not stopping:
                self._keep_memory_checkpoint()
            if self.context.stop_requested:
                # Workers end their current step and retire, and sync shards aggregate over those
                # still running, so every shard ends at the same version. Finishing the shards here
                # instead would race the pushes in flight: one shard could take a step that another
                # (finished first) refuses, and the final state would not be a consistent cut.
                # Asked every turn: a run started since (a replacement's, a rollback's) stops too.
                stopping = True
                self.group.request_stop()
            running = self.group.running
            if running and self._last_step_taken():
                hung = self.group.let_silent_go(min(self.group.timeout_s, SILENT_AT_THE_END_S))
                for loss in hung:
                    self._fault(loss, LET_GO.format(LAST_STEP_TAKEN))
                if hung:  # lost all the same (workers_lost); past the budget's reach, the run being done
                    self.failure_policy.record(hung)
                    self._log_losses()
                running = self.group.running
            if self._pending_replacements and (why := self._why_nothing_is_left()) is not None:
                for worker_id in self._drop_pending_replacements():
                    log.info("worker %d's replacement is not started: %s", worker_id, why)
            if running and not released and self._all_waiting_to_start(running):
                # Those left wait for a global step that no worker will push (GlobalStepWaiter after
                # a stop or the end of the data): nothing is in flight, so end the shards to let them go.
                self._confirm_the_run_is_ours()
                ray.get(self.shard_group.finish())
                released = True
            if self._no_worker_to_come() and not self._backlog and not self._ready_events:
                # (steps a hook's wait drained at the very end are reported by one more turn first)
                self.state = State.FINISHING
        self._confirm_the_run_is_ours()
        # Every worker is done: the state is final (async shards that drifted settle at the furthest).
        self._settle_ended_shards(ray.get(self.shard_group.finish()))
        self._report(self.aggregator.flush())
        self.state = State.FINISHED
        return [summary for _, summary in sorted(self._summaries.items())]

    def _watch_head(self) -> None:
        """The head's silence: a warning as it starts, a fault tag once it is over, saying what the
        run did meanwhile (the training goes on where it needs no GCS: head_watch.py)."""
        silence = self.head_watch.look(self.group.global_step)
        if silence is None:
            return
        if not silence.over:
            log.warning("%s", silence.describe())
        else:
            self._tell_fault(FaultEvent(silence.from_step, silence.describe(), silence.outcome()))

    def _turn(self, *, suspect_shards: bool = False) -> list[Any]:
        """One poll of the cluster and what the failure policy decides about it; returns the step
        records heard of. Raises only to end the run (a user's error, or more losses than allowed)."""
        recovered = len(self.group.recoveries_s)
        self._confirm_the_run_is_ours()
        self.shard_group.spares.refill()  # a spare in each bundle a lost actor left, once Ray frees it
        self.worker_spares.refill()
        self._keep_handover_current()
        self.worker_spares.warm(self._warm_up_spare)  # traces its step ahead, once members have batches
        self._replace_pending()
        if self._pending_replacements and not self.group.running:
            time.sleep(self.poll_s)  # nothing runs until a replacement starts
        status = self.group.poll(self.poll_s)
        self._confirm_the_run_is_ours()  # before acting on what the poll saw (it may have slept through a takeover)
        self._summaries.update(status.finished)
        for seconds in self.group.recoveries_s[recovered:]:  # a replacement's first step: time lost
            self.session.log_metrics({"worker_recovery_s": seconds}, self.group.global_step)
        if status.shard_trouble or suspect_shards or status.lost_workers or self._shards_unsettled:
            # (a lost worker's node may have held a shard too: the shards are looked at first)
            lost_shards = self._lost_shards()
            status.losses.extend(lost_shards)
            if not lost_shards and not self._shards_unsettled:
                self.group.lose_stranded(status)  # a worker's failed call to a shard was not the shard's loss
        decision = self.failure_policy.decide(status)
        if decision is Decision.FAIL:
            self.state = State.ERRORED
            if status.fatal is not None:
                raise status.fatal
            for loss in status.losses:
                self._fault(loss, "failed the run")
            raise TrainingError(self.failure_policy.failure_message())
        if decision is Decision.ROLLBACK_SHARDS:
            self.state = State.RECOVERING
            self._roll_back(status.lost_shards, status.lost_workers)
            self.state = State.RUNNING
            return []  # what the workers reported before the rollback is redone
        if decision is Decision.REPLACE_WORKERS:
            nothing_to_do = self._why_nothing_is_left()
            if nothing_to_do is not None:
                self._retire([loss.index for loss in status.lost_workers])  # sync survivors end their step
                for loss in status.lost_workers:
                    self._fault(loss, LET_GO.format(nothing_to_do))
                self._log_losses()
            elif self.elastic.shrinks_on_loss(len(self.group.running)):
                for loss in status.lost_workers:
                    self._fault(loss, f"went on without it ({len(self.group.running)} worker(s) left)")
                self._log_losses()
                self._resize(leaving=[], joining=[], records=status.records)
                return []  # the resize reports them
            else:
                self.state = State.RECOVERING
                self._replace_workers(status.lost_workers)
                self.state = State.RUNNING
        change = self._membership_change() if self.state is State.RUNNING else None
        if change is not None:
            leaving, joining = change
            self._resize(leaving=leaving, joining=joining, records=status.records)
            return []
        return status.records

    def _no_worker_to_come(self) -> bool:
        """No worker runs, and no replacement is on its way: no step will be taken."""
        return not self.group.running and not self._pending_replacements

    def _count_from(self, feed: DataFeed) -> None:
        """The run counts its data position on from where `feed`'s streams start: a partly read file
        is read again from its start, and a position counted on from the one asked for would be
        ahead of the data by that much, so that the next re-plan (a checkpoint's resume, a rollback,
        a resize) would skip as many examples."""
        if feed.position is not None:
            self.aggregator.examples_seen = feed.position

    def _note_data_end(self, from_step: int, feed: DataFeed) -> None:
        """Where the data planned from `from_step` runs out, where the files' counts tell."""
        if feed.steps is not None:
            self.session.data_steps = from_step + feed.steps

    def _last_step_taken(self) -> bool:
        final = self.session.final_step
        return final is not None and self.group.global_step >= final

    def _why_nothing_is_left(self) -> str | None:
        """Why a replacement would have nothing to do (the run's end is near), or None."""
        if self._last_step_taken():
            return LAST_STEP_TAKEN
        if self.context.stop_requested:
            return "the run is stopping"
        return None

    def _all_waiting_to_start(self, workers: list[int]) -> bool:
        if not all(self._start_steps[w] > self.session.start_step for w in workers):
            return False  # some worker has been training from the start (worker 0 always has)
        version = ray.get(self.shards[0].ping.remote())
        return all(self._start_steps[w] > version for w in workers)

    def _report(self, events) -> None:
        for event in events:
            for hook in self.hooks:
                hook.before_run(self.context, event.global_step)
            for hook in self.hooks:
                hook.after_run(self.context, event)

    # -- where the run stands ----------------------------------------------------------------------
    def _data_position(self) -> dict[str, Any]:
        return {"examples_seen": self.aggregator.examples_seen}

    def _global_step(self) -> int:
        last = self.aggregator.last_event
        return last.global_step if last else 0


def _resumed_from(state: Any) -> str | None:
    """What a resumed run goes on from, as its MLflow run's tags say it."""
    if state is None:
        return None
    if isinstance(state, LiveRun):
        return f"its live shards at step {state.global_step} (taken over: no step redone)"
    return f"its checkpoint of step {state.global_step}"
