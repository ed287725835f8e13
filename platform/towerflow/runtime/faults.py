"""Faults a test or a benchmark injects into workers: slowness, a late start, non-finite losses, a
call to the shards that fails in transit, a worker killed between a push and its record, and
pushes late to one shard only.

Production types carry no test knobs: a caller passes one `FaultInjector` (`towerflow.train(...,
faults=...)`) and every worker asks it. Faults that need no help from the code under test (a
process killed, a node stopped, a process paused) are injected from outside, for real.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import ray


@dataclass(frozen=True)
class FaultInjector:
    # worker id -> seconds each of its steps sleeps before pushing (a straggler)
    step_delay_s: dict[int, float] = field(default_factory=dict)
    # worker id -> global steps [first, stop) whose loss reads NaN on that worker (stop None: for ever)
    nonfinite_loss: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    # worker id -> the global step whose push replies it fails to read, with the error Ray raises
    # for a call to a live actor lost in transit (the shards live on; the pushes may have landed)
    shard_call_lost: dict[int, int] = field(default_factory=dict)
    # worker id -> seconds each of its runs waits before it begins (a run that starts late: its
    # actor's calls run on threads, so a stop sent after it may come first)
    run_start_delay_s: dict[int, float] = field(default_factory=dict)
    # worker id -> global steps [first, stop): at the first of them, once its pushes are applied, its
    # process is SIGKILLed before it records the step (the record, and any not yet drained, is lost)
    killed_before_record: dict[int, tuple[int, int]] = field(default_factory=dict)
    # worker id -> (shard, versions): its pushes to that one shard say they were computed that many
    # versions further back (as a push held up on its way there: bounded staleness drops it at
    # that shard only, so the shards' versions drift apart)
    pushes_older_at_shard: dict[int, tuple[int, int]] = field(default_factory=dict)

    def delay(self, worker: int) -> float:
        return self.step_delay_s.get(worker, 0.0)

    def run_start_delay(self, worker: int) -> float:
        return self.run_start_delay_s.get(worker, 0.0)

    def versions_pushed(self, worker: int, versions: list[int]) -> list[int]:
        if worker not in self.pushes_older_at_shard:  # every bucket's push asks: no copy then
            return versions
        shard, older = self.pushes_older_at_shard[worker]
        return [v - older if s == shard else v for s, v in enumerate(versions)]

    def loss(self, worker: int, global_step: int, loss: float) -> float:
        window = self.nonfinite_loss.get(worker)
        if window is None:
            return loss
        first, stop = window
        return float("nan") if first <= global_step and (stop is None or global_step < stop) else loss

    def check_record(self, worker: int, global_step: int) -> None:
        first, stop = self.killed_before_record.get(worker, (0, 0))
        if first <= global_step < stop:
            os.kill(os.getpid(), signal.SIGKILL)

    def check_shard_call(self, worker: int, global_step: int) -> None:
        if self.shard_call_lost.get(worker) == global_step:
            raise ray.exceptions.ActorUnavailableError(
                f"injected: worker {worker}'s push replies at step {global_step} lost in transit", None
            )
