"""A running job's control point on the Ray cluster: `towerflow scale` leaves a new worker count
there and the controller picks it up at its next poll.

It is a named actor with no resources, in the `towerflow` namespace under the run's id, so any
process connected to the same cluster (a `ray job submit` driver or a shell) finds it; it lives as
long as the job's driver that created it. It sits on the driver's node (a node lost with it would
end the run anyway) and Ray restarts it should it die: losing it must never fail a training run.
"""

from __future__ import annotations

from typing import Any

import ray

from towerflow.errors import ClusterError

NAMESPACE = "towerflow"


def control_name(run_id: str) -> str:
    return f"run-{run_id}"


@ray.remote(num_cpus=0)
class RunControl:
    def __init__(self) -> None:
        self._workers: int | None = None

    def scale(self, workers: int) -> None:
        self._workers = workers

    def wanted_workers(self) -> int | None:
        return self._workers


class ControlPoint:
    """The controller's side: create the named actor, and ask it without blocking."""

    def __init__(self, run_id: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.actor = RunControl.options(
            name=control_name(run_id), namespace=NAMESPACE, scheduling_strategy=here, max_restarts=-1
        ).remote()
        self._asked: Any = None
        self._seen: int | None = None

    def new_worker_count(self) -> int | None:
        """A worker count set since the last call, else None; never waits."""
        if self._asked is None:
            self._asked = self.actor.wanted_workers.remote()
        ready, _ = ray.wait([self._asked], timeout=0)
        if not ready:
            return None
        try:
            wanted = ray.get(self._asked)
        except ray.exceptions.RayError:  # restarting: ask again next time
            return None
        finally:
            self._asked = None
        if wanted is None or wanted == self._seen:
            return None
        self._seen = wanted
        return wanted

    def close(self) -> None:
        ray.kill(self.actor)


def request_scale(run_id: str, workers: int) -> None:
    """Ask the running job `run_id` for `workers` workers (from any process connected to its cluster)."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: a run needs at least one worker")
    try:
        actor = ray.get_actor(control_name(run_id), namespace=NAMESPACE)
    except ValueError:
        raise ClusterError(
            f"no running towerflow job with run id {run_id} on this Ray cluster (it has ended, or runs on "
            "another cluster: set RAY_ADDRESS to that cluster's head)"
        ) from None
    ray.get(actor.scale.remote(workers))
