"""The run's end (mixed into the Driver): the result a finished run reports, the check that a run
trained something, and the release of everything the run held, whatever its outcome.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

import numpy as np
import ray

from towerflow.errors import DataError
from towerflow.runtime.actor_pool import KEPT_ACTORS, IdleActors, current_connection
from towerflow.runtime.actors import kill_quietly
from towerflow.runtime.hooks import RunOutcome
from towerflow.runtime.result import TrainResult, staleness_summary
from towerflow.runtime.run_control import ControlPoint
from towerflow.runtime.run_keeper import LiveRun
from towerflow.shared_types import join_pieces

log = logging.getLogger(__name__)


class RunEnd:
    """The end of a run, for the Driver, which provides the shards, the worker group, the
    aggregator, the session and the data these read."""

    def _result(self, worker_summaries: list[dict[str, Any]], started: float) -> TrainResult:
        shard_stats = ray.get([s.stats.remote() for s in self.shards])
        parameters = self._fetch_parameters() if self.return_parameters else None
        agg = self.aggregator
        last = agg.last_event
        return TrainResult(
            run_id=self.session.tags.get("run_id"),
            status="FINISHED",
            global_step=shard_stats[0]["version"],
            final_loss=last.loss if last else None,
            final_metrics=dict(last.metrics) if last else {},
            examples_seen=agg.examples_seen,
            examples_per_sec=agg.steady_examples_per_sec(),
            wall_s=time.time() - started,
            dropped_stale=sum(s["stale"] for s in shard_stats) // max(1, len(shard_stats)),
            rejected=agg.rejected_total,
            staleness=staleness_summary(agg.staleness),
            workers=worker_summaries,
            shards=shard_stats,
            parameters=parameters,
            model_state=self.model_state() if self.return_parameters else None,
        )

    def _fetch_parameters(self) -> list[np.ndarray]:
        replies = ray.get([s.pull.remote(0) for s in self.shards])
        session = self.session
        whole = join_pieces(ray.get([r.params for r in replies]), session.pieces, session.shard_assignment)
        return [whole[i] for i in sorted(whole)]

    def _check_something_trained(self) -> None:
        """A job whose data ended before its first step trained nothing: fail it, so that no untrained
        model is exported or registered as if it were a result. (A resume at the run's final step,
        max_steps or a hook's last step, is no error.)"""
        final_step = self.session.final_step
        if self.aggregator.last_event is not None or self.context.stop_requested:
            return
        if final_step is not None and self.session.start_step >= final_step:
            return
        data = self.spec.data
        raise DataError(
            f"data.train: the data ended before the first training step ({data.train.paths}, "
            f"data.batch_size {data.batch_size:,} per worker, {self.spec.cluster.workers} worker(s), "
            f"drop_remainder {str(data.drop_remainder).lower()}): nothing was trained. Lower "
            "data.batch_size, or give more data."
        )

    def _release(self, outcome: RunOutcome) -> None:
        self.gcs_answers.close()
        if self._idle is not None and self._idle.keeper is not None:  # taken over, or the run ended first
            with contextlib.suppress(Exception):
                self._idle.keeper.close()
        if outcome.taken_over:
            self._leave_the_run()
            return
        idle = self._actors_to_keep(outcome)
        if idle is None:
            self.group.kill()
            self.shard_group.kill()
        else:
            self.shard_group.spares.kill()
        self.worker_spares.kill()
        self._end_own_actors()
        live = self.initial_state
        if isinstance(live, LiveRun) and self.actor_placement is not live.handover.placement:
            # a lost driver's shards, which this run ended before it took them in
            with contextlib.suppress(Exception):
                if self.control is not None:
                    self.control.end_the_run()
                else:
                    live.control.end_the_run()
            self.control = None
        if idle is not None:
            KEPT_ACTORS.keep(idle, self.spec.cluster.keep_actors_s)
        else:
            with contextlib.suppress(Exception):  # Ray gone already (a lost head) is fine
                self.actor_placement.release()
        if self.control is not None:  # last: a kept run's ends what is left should this be cut short
            with contextlib.suppress(Exception):
                self.control.close()

    def _end_own_actors(self) -> None:
        """This driver's own, not the run's: its data's reads and its evaluator. The reads' claim on
        the cluster's cores goes now, not minutes after (data/splits.py)."""
        with contextlib.suppress(Exception):
            self._close_data(wait_s=10.0, release=True)
        if self._evaluator is not None:
            kill_quietly(self._evaluator)
        self._evaluator = None

    def _leave_the_run(self) -> None:
        """Another driver has the run: end only this driver's own actors, and none of the run's
        shards, workers, spares, placement groups or its control point."""
        self._end_own_actors()
        if self.control is not None:
            self.control.let_go()
        if isinstance(self.initial_state, LiveRun):  # renewing since the take-over, perhaps unmade yet
            self.initial_state.control.let_go()
        self.control = None

    def _actors_to_keep(self, outcome: RunOutcome) -> IdleActors | None:
        """This run's shards and workers, for the next run in this process (runtime/actor_pool.py):
        a finished run's, every worker's run ended and none lost, where `cluster.keep_actors_s`
        asks it; else None (they end now)."""
        cluster, slots = self.spec.cluster, self.group.slots
        if outcome.status != "FINISHED" or not cluster.keep_actors_s or not KEPT_ACTORS.keeping:
            return None
        if (fits := self._reuse) is None:
            return None
        if isinstance(self.initial_state, LiveRun) or not self.actor_placement.groups:
            return None
        if sorted(slots) != list(range(cluster.workers)) or self._pending_replacements:
            return None
        if any(slot.lost or not slot.finished for slot in slots.values()) or len(self.shards) != cluster.ps:
            return None
        try:
            keeper = self._keeper_of_kept_actors() if self.actor_placement.detached else None
        except Exception as exc:  # a control point could not be made: they end with the run
            log.warning("the run's actors end: none could keep them for the next run (%s)", exc)
            return None
        return IdleActors(
            placement=self.actor_placement,
            shards=list(self.shards),
            shard_bundles=self.shard_group.bundles,  # a copy
            workers={worker_id: slot.actor for worker_id, slot in slots.items()},
            fits=fits,
            connection=current_connection(),
            keeper=keeper,
        )

    def _keeper_of_kept_actors(self) -> ControlPoint:
        """A control point of their own for a tracked run's actors while they wait (they outlive a
        lost driver, as the run's control point, which ends with the run, kept them)."""
        grace_s = self.spec.training.failure.driver_grace_s
        keeper = ControlPoint(
            f"kept-{uuid.uuid4().hex[:12]}", grace_s=grace_s, group_names=self.actor_placement.group_names()
        )
        keeper.keep()
        return keeper
