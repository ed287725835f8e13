"""What the controller hears from the cluster each turn, and the policy that decides what to do.

As in Ray Train v2's controller, a poll never raises for a lost actor: it returns the cluster's
status as data (steps heard of, workers finished, workers and shards lost, a user's error), and a
small `FailurePolicy` turns that into one decision. Only the controller acts on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class LossKind(enum.Enum):
    WORKER = "worker"
    SHARD = "parameter server"


@dataclass(frozen=True)
class ActorLoss:
    """One training actor lost: died (its process or node) or hung (no step for the timeout)."""

    kind: LossKind
    index: int  # worker id or shard index
    at_step: int  # the global step the controller had heard of when it noticed
    cause: str  # one line: what Ray said, or "no step for N s"
    hung: bool = False

    def describe(self) -> str:
        what = "hung" if self.hung else "lost"
        return f"{self.kind.value} {self.index} {what} at step {self.at_step}: {self.cause}"


@dataclass
class ClusterStatus:
    """One poll of the cluster: what happened since the previous one."""

    records: list[Any] = field(default_factory=list)  # StepRecords drained from the workers
    finished: dict[int, dict[str, Any]] = field(default_factory=dict)  # worker id -> its run summary
    losses: list[ActorLoss] = field(default_factory=list)
    user_error: BaseException | None = None  # raised by the user's model, data or spec: not retried
    # The run cannot go on and no new actor would help: every worker starved of data for too long.
    stalled: BaseException | None = None
    shard_trouble: bool = False  # a worker's call to a shard failed: the controller checks the shards

    def absorb(self, other: ClusterStatus) -> None:
        """Add a later poll's findings to this one."""
        self.records.extend(other.records)
        self.finished.update(other.finished)
        self.losses.extend(other.losses)
        self.user_error = self.user_error or other.user_error
        self.stalled = self.stalled or other.stalled
        self.shard_trouble |= other.shard_trouble

    @property
    def fatal(self) -> BaseException | None:
        """The error that ends the run whatever the budgets allow, if any."""
        return self.user_error or self.stalled

    @property
    def lost_workers(self) -> list[ActorLoss]:
        return [loss for loss in self.losses if loss.kind is LossKind.WORKER]

    @property
    def lost_shards(self) -> list[ActorLoss]:
        return [loss for loss in self.losses if loss.kind is LossKind.SHARD]


class Decision(enum.Enum):
    CONTINUE = "continue"
    REPLACE_WORKERS = "replace workers"
    ROLLBACK_SHARDS = "roll the shards back"
    FAIL = "fail"


@dataclass
class FailurePolicy:
    """Replace lost workers and roll lost shards back, each up to its budget for the run; then fail.

    A user's error (the model's code, bad data, a spec that does not fit) is never retried: a new
    actor would raise it again.
    """

    max_worker_failures: int = 3
    max_ps_failures: int = 3
    history: list[ActorLoss] = field(default_factory=list)

    def decide(self, status: ClusterStatus) -> Decision:
        if status.fatal is not None:
            return Decision.FAIL
        if not status.losses:
            return Decision.CONTINUE
        self.record(status.losses)
        if self.over_budget():
            return Decision.FAIL
        return Decision.ROLLBACK_SHARDS if status.lost_shards else Decision.REPLACE_WORKERS

    def failure_message(self) -> str:
        workers, shards = self.lost(LossKind.WORKER), self.lost(LossKind.SHARD)
        budget = (
            f"training.failure allows {self.max_worker_failures} worker and {self.max_ps_failures} "
            f"parameter-server failure(s) a run; this run had {workers} and {shards}"
        )
        events = "; ".join(loss.describe() for loss in self.history)
        return f"too many training actors lost ({budget}): {events}"

    def record(self, losses: list[ActorLoss]) -> None:
        """Losses the run met that no decision is left to make on (a worker let go at the end)."""
        self.history.extend(losses)

    def over_budget(self) -> bool:
        """More workers or shards lost than the run allows."""
        return (
            self.lost(LossKind.WORKER) > self.max_worker_failures
            or self.lost(LossKind.SHARD) > self.max_ps_failures
        )

    def lost(self, kind: LossKind) -> int:
        """Actors of `kind` lost so far."""
        return sum(1 for loss in self.history if loss.kind is kind)
