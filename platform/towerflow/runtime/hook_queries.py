"""What hooks may ask of the running cluster (`TrainingRuntime`, mixed into the Driver), checkpoints
apart (checkpointing.py): the workers' non-trainable state, their profiles, an evaluation of the
current parameters, the last step heard of.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import ray

from towerflow.runtime.model_state import average_model_states
from towerflow.runtime.recovery import State
from towerflow.runtime.tf_setup import TFProcessConfig
from towerflow.runtime.worker import worker_actor


class HookQueries:
    """Queries of the Driver, which provides the worker group, the shards, the state and the
    aggregator these read."""

    def model_state(self) -> dict[str, np.ndarray]:
        """The workers' non-trainable variables, averaged (batch-norm statistics); {} if the model has none.

        Read as the workers are now, not at the shards' cut: they are running averages, which the
        replicas update each on its own data, and never part of the gradient step.
        """
        if self._final_model_state is not None:
            return self._final_model_state
        averaged = self._averaged_model_state(self._ask_model_state(), timeout_s=30)
        if self.state is State.FINISHED:  # final: an evaluation on a worker (below) must not change it
            self._final_model_state = averaged
        return averaged

    def _ask_model_state(self) -> list[Any]:
        """Ask every worker for its non-trainable state: the refs of their answers."""
        if not self.workers or self._model_has_state is False:
            return []  # most models have none: no round trip to every worker at each checkpoint
        return [w.model_state.remote() for w in self.workers]

    def _averaged_model_state(self, refs: list[Any], timeout_s: float) -> dict[str, np.ndarray]:
        """The average of the answers to `_ask_model_state` that come within `timeout_s`."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        states = []
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):  # a lost worker: average the others
                states.append(ray.get(ref))
        if states:
            self._model_has_state = bool(states[0])
        return average_model_states(states)

    def profiles(self, workers: list[int]) -> dict[int, dict[str, Any] | None]:
        slots = self.group.slots
        chosen = [w for w in workers if w in slots and not slots[w].lost]
        return dict(zip(chosen, ray.get([slots[w].actor.profile.remote() for w in chosen])))

    def evaluate(
        self,
        source: Any,
        metrics: list[str],
        batch_size: int,
        max_batches: int | None,
    ):
        """Start an evaluation of the current parameters on the evaluator actor; returns a Future.

        Once the training is over, a run that has not started its evaluator evaluates on a worker
        instead: they are idle then, and a new actor would import TensorFlow and build the model
        first (about 5 s of a short run's end on 2 cores).
        """
        model_state = self.model_state()
        evaluator = self._evaluator
        if evaluator is None and self.state is State.FINISHED and self.workers:
            evaluator = self.workers[0]
        if evaluator is None:
            config = self._idless_worker_config()
            config.tf = TFProcessConfig(cpus=1.0)
            # No CPU reservation: evaluations are short and occasional, and must not wait for a slot.
            evaluator = self._evaluator = worker_actor(0, 0).remote(config)
        ref = evaluator.evaluate.remote(
            self.shards, self._placement(), source, metrics, batch_size, max_batches, model_state
        )
        return ref.future()

    def last_event(self):
        """The newest step event heard of (None before the first)."""
        return self.aggregator.last_event
