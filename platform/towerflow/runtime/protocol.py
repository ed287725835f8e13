"""Update protocols: the one place that decides sync or async.

A parameter-server shard asks its protocol about every pushed gradient and does what it answers:
add it to the step being built and wait (held), add it and apply the mean of the step's gradients
now, or drop it. The protocol only decides; the shard keeps the sum (its gradient accumulator).
Workers ask the same object which version they must wait for before their next step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from towerflow.shared_types import StepShape


class Verdict(str, enum.Enum):
    """What becomes of a pushed gradient, from the protocol's decision to the worker's step record.
    A str, so records, counters and logs read as the plain word."""

    HELD = "held"  # the protocol: added to the step being built; wait for it
    APPLY = "apply"  # the protocol: apply the step now
    APPLIED = "applied"  # the shard's reply: it went into an update
    STALE = "stale"  # computed against an older version than the protocol takes: dropped
    REJECTED = "rejected"  # a second push for one step: a protocol bug, dropped
    # from a worker retired or replaced under its id (a lost one's late push), or, async, of a run
    # before the shard's rollback: dropped
    RETIRED = "retired"
    SKIPPED = "skipped"  # its loss was not finite (nan_guard: skip): counted, nothing added
    DONE = "done"  # the shard had finished: no more steps
    PARTIAL = "partial"  # the worker's record: the shards answered differently
    NONFINITE = "nonfinite"  # the worker's record: its loss was not finite, nothing pushed

    def __str__(self) -> str:
        return self.value


@dataclass
class Decision:
    verdict: Verdict
    count: int = 0  # when verdict is APPLY: how many gradients the update averages
    staleness: int = 0


@dataclass
class SyncProtocol:
    """SyncReplicasOptimizer semantics.

    A shard applies one update when it holds `replicas_to_aggregate` gradients computed against its
    current version; gradients computed against an older version are dropped. With more workers than
    that (backup workers) the slowest gradients of each step are the ones dropped.

    A worker takes part from its join, as one incarnation (a number of its run's own), until it
    retires. A push of another incarnation is dropped: a lost worker's push that arrives after the
    driver retired it, or after its replacement joined under its id, would otherwise count in a
    step, in the replacement's place.
    """

    # Every worker waits for each update: workers get equal data shares, pushing gradients in
    # buckets during backprop pays, and the shards may use the waiting workers' cores to apply.
    lockstep: ClassVar[bool] = True
    # Every shard applies every step's update, so the shards stay at one version.
    versions_drift: ClassVar[bool] = False
    replicas_to_aggregate: int
    total_num_replicas: int
    _held: set[int] = field(default_factory=set)  # workers whose gradient the step being built holds
    _retired: set[int] = field(default_factory=set)
    _members: dict[int, int] = field(default_factory=dict)  # worker id -> the incarnation taking part

    @property
    def required(self) -> int:
        active = self.total_num_replicas - len(self._retired)
        return max(1, min(self.replicas_to_aggregate, active))

    def on_push(self, version_read: int, version: int, worker: int, incarnation: int) -> Decision:
        if version_read < version:
            return Decision(Verdict.STALE, staleness=version - version_read)
        if self._members.get(worker) != incarnation:
            return Decision(Verdict.RETIRED)
        if worker in self._held:
            # A worker contributes once per step; a second push for the same version is a protocol bug.
            return Decision(Verdict.REJECTED)
        self._held.add(worker)
        return self._maybe_complete()

    def on_retire(self, worker: int, incarnation: int | None = None) -> Decision:
        """A worker has left (its data ran out, or it died): aggregate over those still running.
        `incarnation` None (the driver, of a lost worker): whichever takes part; an incarnation that
        no longer does (replaced meanwhile) retires nobody."""
        if incarnation is not None and self._members.get(worker) != incarnation:
            return Decision(Verdict.HELD)
        self._members.pop(worker, None)
        self._retired.add(worker)
        return self._maybe_complete()

    def on_join(self, worker: int, incarnation: int) -> None:
        """A worker (at its run's start; a replacement under a lost one's id) takes part in the steps
        from now on, as `incarnation`."""
        self._members[worker] = incarnation
        self._retired.discard(worker)

    def resize(self, total_num_replicas: int, replicas_to_aggregate: int) -> None:
        """A new set of workers (an elastic resize), each to join; called between steps, none held."""
        self.total_num_replicas, self.replicas_to_aggregate = total_num_replicas, replicas_to_aggregate
        self._held, self._retired, self._members = set(), set(), {}

    def _maybe_complete(self) -> Decision:
        if not self._held or len(self._held) < self.required:
            return Decision(Verdict.HELD)
        count, self._held = len(self._held), set()
        return Decision(Verdict.APPLY, count=count)

    def next_version_to_read(self, version_read: int) -> int:
        # Wait for the update this gradient went into: a worker never computes twice on one version.
        return version_read + 1


@dataclass
class AsyncProtocol:
    """Downpour: every push is applied at once; with `max_staleness`, older gradients are rejected."""

    lockstep: ClassVar[bool] = False  # no worker waits for another; staleness is what to watch
    # Each shard judges a push's staleness on its own: a late gradient one applies another may
    # drop, and a lost worker's push may reach only some; their versions (counts of updates)
    # drift apart by those.
    versions_drift: ClassVar[bool] = True
    max_staleness: int | None = None

    def on_push(self, version_read: int, version: int, worker: int, incarnation: int) -> Decision:
        staleness = version - version_read
        if staleness < 0:  # read from a version this shard no longer has: an earlier run's (a rollback since)
            return Decision(Verdict.RETIRED)
        if self.max_staleness is not None and staleness > self.max_staleness:
            return Decision(Verdict.STALE, staleness=staleness)
        return Decision(Verdict.APPLY, count=1, staleness=staleness)

    def on_retire(self, worker: int, incarnation: int | None = None) -> Decision:
        return Decision(Verdict.HELD)

    def on_join(self, worker: int, incarnation: int) -> None:
        return None  # a late gradient of a lost worker is one more stale gradient, bounded as any

    def resize(self, total_num_replicas: int, replicas_to_aggregate: int) -> None:
        return None  # every push applies on its own, however many workers there are

    def next_version_to_read(self, version_read: int) -> int:
        return 0  # whatever is newest; never wait for other workers


UpdateProtocol = SyncProtocol | AsyncProtocol


def protocol_for(mode: str) -> type[SyncProtocol] | type[AsyncProtocol]:
    """The protocol class of a training mode: what the rest of the system asks instead of the mode's name."""
    protocols = {"sync": SyncProtocol, "async": AsyncProtocol}
    if mode not in protocols:
        raise ValueError(f"unknown training mode {mode!r}; choose sync or async")
    return protocols[mode]


def step_shape(mode: str, replicas_to_aggregate: int) -> StepShape:
    """A sync update takes `replicas_to_aggregate` batches, one from each of as many workers; async, one."""
    lockstep = protocol_for(mode).lockstep
    return StepShape(lockstep, replicas_to_aggregate if lockstep else 1)


def make_protocol(
    mode: str, *, replicas_to_aggregate: int, total_num_replicas: int, max_staleness: int | None
) -> UpdateProtocol:
    if protocol_for(mode).lockstep:
        return SyncProtocol(replicas_to_aggregate, total_num_replicas)
    return AsyncProtocol(max_staleness)
