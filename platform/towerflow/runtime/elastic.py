"""Elastic workers: how many a run trains with, between `cluster.workers: {min, max}`.

The run starts with as many workers as the cluster has room for (at least min), and asks Ray for
the rest as spare actors: Ray starts a spare when room appears (a node joins; on KubeRay the
autoscaler adds one for it), and the run then grows to take it in. A worker lost with its node
is not waited for while the run keeps at least min workers: the run shrinks instead, and asks for
a spare in its place. `towerflow scale RUN_ID --workers K` sets a new target.

Sync steps aggregate all running workers but the backup ones: replicas_to_aggregate is the number
of running workers less the spec's backup workers (total_num_replicas - replicas_to_aggregate, read
at the most workers), and at least 1.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


@dataclass
class ElasticPolicy:
    fewest: int  # min workers (lower while a `towerflow scale` target is below the spec's)
    most: int  # max workers (the target until a `towerflow scale`)
    backups: int = 0  # sync backup workers, kept at every size
    spec_fewest: int | None = None  # the spec's min, which a later, larger target restores

    def __post_init__(self) -> None:
        if self.spec_fewest is None:
            self.spec_fewest = self.fewest

    @classmethod
    def for_spec(cls, spec: Any) -> ElasticPolicy:
        cluster = spec.cluster
        return cls(cluster.fewest_workers, cluster.workers, cluster.workers - spec.replicas_to_aggregate)

    @property
    def elastic(self) -> bool:
        return self.fewest < self.most

    @property
    def target(self) -> int:
        return self.most

    def scale_to(self, workers: int) -> None:
        """A new target (towerflow scale): the run grows to it as room appears, or shrinks to it now."""
        self.most = workers
        self.fewest = min(self.spec_fewest, workers)  # a target under the spec's min, for as long as it holds

    def start_count(self, room: int) -> int:
        """Workers to start with, where the cluster has `room` for that many now."""
        return max(self.fewest, min(self.most, room))

    def shrinks_on_loss(self, running_after: int) -> bool:
        """Go on without a lost worker (and ask for a spare) rather than wait for its replacement."""
        return self.elastic and running_after >= self.fewest

    def replicas_to_aggregate(self, workers: int) -> int:
        return max(1, workers - self.backups)

    def spares_wanted(self, running: int, pending: int) -> int:
        """Spares to ask Ray for (negative: to withdraw) so that running + pending meets the target."""
        return self.target - running - pending

    def resize(
        self, members: list[int], started_spares: list[int], going: Collection[int] = ()
    ) -> tuple[list[int], list[int]] | None:
        """(workers to let go, started spares to take in) toward the target; None: no change.
        The newest workers go first; worker 0 stays while any does. `going`: members on a node
        that is about to go (runtime/draining.py); each leaves as a started spare takes its place
        (or at once, where the target has no place for it), and trains on until then."""
        going = [m for m in sorted(members) if m in set(going)]
        staying = [m for m in sorted(members) if m not in going]
        leaving = staying[self.target :]
        kept = len(staying) - len(leaving)
        joining = started_spares[: max(0, self.target - kept)]
        leaving += going[max(0, self.target - kept - len(joining)) :]
        return (sorted(leaving), joining) if leaving or joining else None


def workers_that_fit(cluster: Any, available: dict[str, float]) -> int:
    """How many workers the free resources hold once the shards and Ray Data have theirs."""
    cpus = available.get("CPU", 0.0) - cluster.shard_processes * cluster.cpus_per_ps - cluster.data_cpus
    return workers_of_size(cluster, cpus, available.get("GPU", 0.0), cluster.cpus_per_worker)


def workers_of_size(cluster: Any, cpus: float, gpus: float, cpus_per_worker: float) -> int:
    """How many workers of `cpus_per_worker` CPUs (and the spec's GPUs each) `cpus` and `gpus` hold."""
    fit = math.floor(cpus / cpus_per_worker + 1e-9)
    if cluster.gpus_per_worker:
        fit = min(fit, math.floor(gpus / cluster.gpus_per_worker + 1e-9))
    return max(0, fit)
