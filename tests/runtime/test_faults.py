"""Faults injected for real into running jobs on the session's Ray: a worker's process SIGKILLed,
a worker paused (SIGSTOP) until it counts as hung, NaN losses skipped. The multi-node faults (a
node stopped) are in test_multinode_cluster.py and test_multinode_draining.py.

Tests whose runs have one placement (shards, workers, spares) follow each other where they can: a
finished run's actors wait for the next run that fits them (runtime/actor_pool.py)."""

from __future__ import annotations

import math
import os
import re
import signal

import numpy as np
import pytest
import ray
from support import blob_spec

from towerflow.errors import TrainingError
from towerflow.launch import train
from towerflow.runtime import driver as driver_module
from towerflow.runtime.driver import LAST_STEP_TAKEN
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook
from towerflow.runtime.scratch import scratch_root
from towerflow.spec import validate_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BATCH = 16


class FaultAt(Hook):
    """Sends `sig` to worker `worker`'s process when the chief hears of `step`; records what follows."""

    def __init__(self, step: int, worker: int = 1, sig: int = signal.SIGKILL, times: int = 1) -> None:
        self.step, self.worker, self.sig, self.times = step, worker, sig, times
        self.events, self.faults, self.metrics, self.killed_at, self.killed = [], [], {}, [], []
        self.killed_pids: list[int] = []
        self.scratch_files: list[int] = []  # autograph's files in each killed one's scratch folder
        self.data_steps = []

    def after_run(self, context, event):
        self.events.append(event)
        if len(self.killed_at) < self.times and event.global_step >= self.step * (len(self.killed_at) + 1):
            actor = context.session.runtime.group.slots[self.worker].actor
            if actor in self.killed:
                return  # async: the others reached the next kill's step before the loss was noticed
            pid = ray.get(actor.pid.remote())
            self.scratch_files.append(len(list(scratch_root().glob(f"{pid}-*/__autograph_generated_file*"))))
            os.kill(pid, self.sig)
            self.killed_pids.append(pid)
            self.killed.append(actor)
            self.killed_at.append(event.global_step)

    def on_fault(self, event):
        self.faults.append(event)

    def on_metrics(self, metrics, step):
        self.metrics.update(metrics)


def _spec(blob_data, **training):
    return validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": BATCH, "epochs": training.pop("epochs", 1)},
            cluster={"workers": 2, "ps": 1},
            training={"optimizer": {"name": "sgd", "learning_rate": 0.05}, **training},
            supervision={"checkpoint": {"every_steps": 5}},
        )
    )


def _falls(losses: list[float]) -> bool:
    return np.mean(losses[-5:]) < np.mean(losses[:5])


def test_sync_worker_killed_is_replaced_and_the_epoch_loses_no_example(ray_cluster, blob_data, tmp_path):
    spec = _spec(blob_data, mode="sync", max_steps=None)
    hook = FaultAt(step=6)
    # 0.1 s a step: the epoch (32 steps) outlasts the kill. Unslowed, in a fast hour, both workers had
    # used up their data by the time the chief heard of step 6: the kill came after the end.
    slow = FaultInjector(step_delay_s={0: 0.1, 1: 0.1})
    result = train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=slow)
    assert hook.killed_at, "the worker was never killed"
    assert [f.action for f in hook.faults] == ["replaced"]
    assert "worker 1 lost" in hook.faults[0].what
    assert hook.metrics["workers_lost"] == 1 and hook.metrics["workers_replaced"] == 1
    assert 0 < hook.metrics["worker_recovery_s"] < 120  # loss noticed -> the replacement's first step
    # Every example of the epoch was used (the batches in flight at the kill, at most, twice): as the
    # shard counts, for the chief may not hear of the lost worker's last steps, applied all the same.
    counts = result.shards[0]
    assert 1024 <= BATCH * (counts["gradients"] + counts["stale"]) <= 1024 + 2 * BATCH
    # The replacement trained: steps after it started hold worker 1's gradients again.
    assert any(1 in e.workers for e in hook.events if e.global_step > hook.killed_at[0] + 2)
    assert _falls([e.loss for e in hook.events[hook.killed_at[0] :]])
    assert [e.global_step for e in hook.events] == list(range(1, result.global_step + 1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())  # checkpoints went on
    # The killed worker's temporary files (autograph's, of its traced step) went with it: the
    # replacement, starting on the same node, removed its scratch folder.
    assert hook.scratch_files[0] > 0
    assert not [d for d in scratch_root().iterdir() if d.name.startswith(f"{hook.killed_pids[0]}-")]


def test_a_call_to_a_live_shard_lost_in_transit_costs_the_worker_not_its_data(
    ray_cluster, blob_data, tmp_path
):
    """The worker's run ends on Ray's error for a call lost in transit while every shard lives on:
    it is replaced like a lost worker (its split's rest read by the replacement), not left finished
    with the epoch's rest unread and the run a worker short."""
    spec = _spec(blob_data, mode="sync", max_steps=None)
    hook = FaultAt(step=10**9)  # nothing killed: it records the steps and faults
    faults = FaultInjector(step_delay_s={0: 0.1, 1: 0.1}, shard_call_lost={1: 6})
    result = train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=faults)
    assert [f.action for f in hook.faults] == ["replaced"]
    assert "worker 1 lost" in hook.faults[0].what and "every one answers" in hook.faults[0].what
    assert "unavailable" in hook.faults[0].what
    assert hook.metrics["workers_lost"] == 1 and hook.metrics["workers_replaced"] == 1
    counts = result.shards[0]  # the whole epoch was used (the step in flight, at most, twice)
    assert 1024 <= BATCH * (counts["gradients"] + counts["stale"]) <= 1024 + 2 * BATCH
    assert any(1 in e.workers for e in hook.events if e.global_step > 10)  # the replacement trained
    assert [e.global_step for e in hook.events] == list(range(1, result.global_step + 1))


def test_a_hung_worker_is_killed_and_replaced(ray_cluster, blob_data, tmp_path):
    spec = _spec(blob_data, mode="sync", max_steps=60, epochs=None, failure={"worker_timeout_s": 4})
    hook = FaultAt(step=10, sig=signal.SIGSTOP)  # alive, but never answers again
    # 0.05 s a step: the 50 steps after the stop outlast the chief's lag (and two checkpoints).
    slow = FaultInjector(step_delay_s={0: 0.05, 1: 0.05})
    result = train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=slow)
    assert result.global_step == 60
    assert len(hook.faults) == 1 and "hung" in hook.faults[0].what, [(f.what, f.action) for f in hook.faults]
    assert "worker_timeout_s" in hook.faults[0].what


@pytest.mark.parametrize("timeout_s", [300, 12])
def test_a_worker_hung_when_the_last_step_is_taken_is_let_go_not_waited_for(
    ray_cluster, blob_data, tmp_path, timeout_s, monkeypatch
):
    """Async: worker 0 takes the run to max_steps while worker 1 is paused. The run's end does not
    wait out a long timeout (300 s here, 600 by default): worker 1 is let go once silent for
    `SILENT_AT_THE_END_S` (15 s; 5 here, the driver being this process); found hung by a shorter
    one (12 s: worker 0's 30 steps alone take 3-10 s), it is not replaced, there being no step left."""
    if timeout_s == 300:
        monkeypatch.setattr(driver_module, "SILENT_AT_THE_END_S", 5.0)
    spec = _spec(blob_data, mode="async", max_steps=40, epochs=None, failure={"worker_timeout_s": timeout_s})
    hook = FaultAt(step=10, sig=signal.SIGSTOP)
    slow = FaultInjector(step_delay_s={0: 0.05, 1: 0.05})
    result = train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=slow)
    assert hook.killed_at and result.global_step == 40
    (fault,) = hook.faults
    assert "worker 1 hung" in fault.what, fault
    assert fault.action == "let go, not replaced: the run's last step was taken"
    assert hook.metrics.get("workers_replaced", 0) == 0  # no replacement was started
    assert hook.metrics.get("workers_lost") == 1  # but it was lost


class StopWhenReplaced(FaultAt):
    """Asks the run to stop as the lost worker's replacement is made (it is still starting)."""

    def after_run(self, context, event):
        self.context = context
        super().after_run(context, event)

    def on_fault(self, event):
        super().on_fault(event)
        self.context.request_stop("a stop as the replacement starts")


class StopAtTheKill(FaultAt):
    """Asks the run to stop at once after the kill, before the loss is noticed."""

    def after_run(self, context, event):
        super().after_run(context, event)
        if self.killed_at:
            context.request_stop("a stop right after the kill")


def test_a_stop_reaches_a_replacement_whose_run_begins_after_it(ray_cluster, blob_data, tmp_path):
    """A worker's calls run on threads: the stop sent to a replacement still starting may come
    before its run begins (held back here 3 s). It stops all the same; the run does not go on
    with the replacement alone to max_steps."""
    spec = _spec(blob_data, mode="async", max_steps=400, epochs=None)
    hook = StopWhenReplaced(step=20)
    faults = FaultInjector(step_delay_s={0: 0.1, 1: 0.1}, run_start_delay_s={1: 3.0})
    result = train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=faults)
    assert [f.action for f in hook.faults] == ["replaced"]
    assert result.global_step < 100, result.global_step  # 400 before: the replacement trained on alone
    assert not any(1 in e.workers for e in hook.events if e.global_step > hook.killed_at[0] + 10)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_lost_while_the_run_stops_is_let_go_not_replaced(ray_cluster, blob_data, tmp_path, mode):
    """Sync: the shards retire it, or the survivors' last push waits for its gradient for ever
    (the run hung until the worker timeout)."""
    spec = _spec(blob_data, mode=mode, max_steps=400, epochs=None)
    hook = StopAtTheKill(step=20)
    faults = FaultInjector(step_delay_s={0: 0.1, 1: 0.1})
    result = train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=faults)
    (fault,) = hook.faults
    assert "worker 1 lost" in fault.what
    assert fault.action == "let go, not replaced: the run is stopping"
    assert hook.metrics.get("workers_replaced", 0) == 0 and hook.metrics["workers_lost"] == 1
    assert result.global_step < 100


class KillWorkerBesideSpares(FaultAt):
    """FaultAt that kills once `step` is heard of and the spare has traced its step ahead; notes the
    run's warm spare workers (their actor ids) at the kill, and which actor holds the lost worker's
    id and which spares wait once it is replaced."""

    def after_run(self, context, event):
        runtime = context.session.runtime
        if not self.killed_at and event.global_step >= self.step:
            if not runtime.worker_spares.warmed():
                self.events.append(event)
                return  # the next event's turn may find it warmed
            self.spares_at_kill = [actor._actor_id for actor, _ in runtime.worker_spares.spares]
        super().after_run(context, event)
        holder = runtime.group.slots[self.worker].actor
        if self.killed and holder is not self.killed[0]:
            self.after_kill = (
                holder._actor_id,
                [actor._actor_id for actor, _ in runtime.worker_spares.spares],
            )


# Sync without a spare worker (a new actor is started: the first test), async with one.
def test_async_worker_killed_is_replaced_by_a_warm_spare_and_the_run_ends_at_max_steps(
    ray_cluster, blob_data, tmp_path
):
    raw = blob_spec(
        blob_data,
        data={"batch_size": BATCH, "epochs": None},
        cluster={"workers": 2, "ps": 1, "spare_workers": 1},
        training={"mode": "async", "max_steps": 200, "optimizer": {"name": "sgd", "learning_rate": 0.05}},
        supervision={"checkpoint": {"every_steps": 5}},
    )
    hook = KillWorkerBesideSpares(step=20)
    # 0.1 s a step: worker 0 alone takes 18 s to max_steps, the warm spare a few to take over.
    slow = FaultInjector(step_delay_s={0: 0.1, 1: 0.1})
    result = train(validate_spec(raw), hooks=[hook], track=False, output_dir=tmp_path, faults=slow)
    assert result.global_step == 200
    assert [f.action for f in hook.faults] == ["replaced by a warm spare"]
    holder, spares_after = hook.after_kill
    assert [holder] == hook.spares_at_kill  # the spare took worker 1's id
    assert len(spares_after) == 1 and spares_after[0] != holder  # a new spare in the lost one's bundle
    assert hook.metrics["workers_replaced"] == 1
    assert 0 < hook.metrics["worker_recovery_s"] < 120
    # The spare trained under worker 1's id, on the step it traced ahead (no trace in its run).
    assert any(1 in e.workers for e in hook.events if e.global_step > hook.killed_at[0] + 5)
    assert {w["worker"]: w["traces"] for w in result.workers}[1] == 0, result.workers
    assert _falls([e.loss for e in hook.events])


class KeepsTheRuntime(FaultAt):
    """Records only, and keeps the run's runtime for a look at the end."""

    def __init__(self) -> None:
        super().__init__(step=10**9)

    def after_run(self, context, event):
        super().after_run(context, event)
        self.runtime = context.session.runtime


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_killed_between_its_push_and_its_record_holds_no_report(
    ray_cluster, blob_data, tmp_path, mode
):
    """Its gradient went into a step whose record never comes: the controller writes the record
    off when it retires the worker, and the steps go out at once. Before, every later step's
    report (hooks, checkpoints, the stop) waited the aggregator's 5-s grace."""
    spec = _spec(blob_data, mode=mode, max_steps=200, epochs=None)  # > 5 s after the kill
    hook = KeepsTheRuntime()
    # Worker 1 dies at its first step in [10, 20) (async, it reads every other version or so: a
    # narrower window, [10, 14), was once passed over whole on busy cores, and nothing was lost),
    # seconds before its replacement could start and reach such a step.
    faults = FaultInjector(killed_before_record={1: (10, 20)}, step_delay_s={0: 0.05, 1: 0.05})
    train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=faults)
    fault = hook.faults[0]  # (the replacement, if the run outlasts its start, or let go)
    assert "worker 1 lost" in fault.what and fault.action in (
        "replaced",
        f"let go, not replaced: {LAST_STEP_TAKEN}",
    )
    assert hook.runtime.aggregator.overdue_total == 0
    reported = [e.global_step for e in hook.events]
    missing = set(range(reported[0], reported[-1] + 1)) - set(reported)
    # Sync: worker 0's record names every step. Async: the steps worker 1 alone made, whose records
    # died with it (the last, and any not yet drained), are not reported; none after.
    if mode == "sync":
        assert not missing, missing
    else:
        assert missing and max(missing) < 20, missing


def test_more_losses_than_allowed_fail_the_run_naming_each(ray_cluster, blob_data, tmp_path):
    spec = _spec(blob_data, mode="async", max_steps=400, epochs=None, failure={"max_worker_failures": 1})
    hook = FaultAt(step=10, times=2)
    # 0.08 s a step: the run outlasts both losses (unslowed, in a fast hour, worker 0 alone could
    # reach max_steps before the replacement started and was lost in turn; in a slow hour the
    # replacement's start, which the second kill waits for, takes 10-20 s).
    slow = FaultInjector(step_delay_s={0: 0.08, 1: 0.08})
    with pytest.raises(TrainingError, match="too many training actors lost") as raised:
        train(spec, hooks=[hook], track=False, output_dir=tmp_path, faults=slow)
    assert str(raised.value).count("worker 1 lost") == 2
    assert [f.action for f in hook.faults] == ["replaced", "failed the run"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nan_guard_skip_drops_nonfinite_gradients_and_trains_on(ray_cluster, blob_data, tmp_path, mode):
    raw = blob_spec(
        blob_data,
        # Skipped batches use data too (async worker 0 spins through them): 20 epochs, not enough
        # for max_steps alone (data.epochs unset) but enough for the skipped ones as well.
        data={"batch_size": BATCH, "epochs": 20},
        cluster={"workers": 2, "ps": 1},
        training={"mode": mode, "max_steps": 60},
        supervision={"nan_guard": "skip"},
    )
    hook = FaultAt(step=10**9)  # records only
    # Worker 0's loss is NaN at the steps in [5, 30) it computes (async: those of the versions it
    # reads). Async worker 0 can start 8+ versions late and read whichever version is newest: the
    # window is wide and worker 1 slowed (0.05 s a step) so that worker 0 cannot skip all of it.
    faults = FaultInjector(nonfinite_loss={0: (5, 30)}, step_delay_s={1: 0.05})
    result = train(validate_spec(raw), hooks=[hook], track=False, output_dir=tmp_path, faults=faults)
    assert result.global_step == 60
    assert hook.metrics["nonfinite_skipped"] >= 1
    # ... and worker 0 trains on once its window has passed.
    assert any(0 in e.workers and not e.nonfinite for e in hook.events if e.global_step > 31)
    assert all(math.isfinite(e.loss) for e in hook.events if not e.nonfinite)
    assert all(np.isfinite(p).all() for p in result.parameters)
    assert result.shards[0]["skipped"] >= 1


class KillShardAt(FaultAt):
    """SIGKILLs shard `worker`'s process when the chief hears of `step` (and worker `with_worker`'s
    right after it: a node's loss); keeps the version the shard had reached then (the chief hears
    of steps late, async most: the shards may be well past it)."""

    def __init__(self, step: int, worker: int, with_worker: int | None = None) -> None:
        super().__init__(step, worker)
        self.with_worker = with_worker

    def after_run(self, context, event):
        self.events.append(event)
        self.data_steps.append(context.session.data_steps)  # where the data ends, as planned then
        runtime = context.session.runtime
        group = runtime.shard_group
        if not self.killed_at and event.global_step >= self.step:
            shard = runtime.shards[self.worker]
            self.version_at_kill = ray.get(shard.ping.remote())
            self.spare_pids = [ray.get(actor.pid.remote()) for actor, _ in group.spares.spares]
            self.spare_workers = [actor._actor_id for actor, _ in runtime.worker_spares.spares]
            os.kill(ray.get(shard.pid.remote()), signal.SIGKILL)
            if self.with_worker is not None:
                os.kill(ray.get(runtime.group.slots[self.with_worker].actor.pid.remote()), signal.SIGKILL)
            self.killed_at.append(event.global_step)
            self.killed.append(shard)
        elif self.killed_at and group.actors[self.worker] is not self.killed[0]:  # once replaced
            self.after_kill = {
                "shard_pid": ray.get(group.actors[self.worker].pid.remote()),
                "spare_pids": [ray.get(actor.pid.remote()) for actor, _ in group.spares.spares],
                "spare_workers": [actor._actor_id for actor, _ in runtime.worker_spares.spares],
            }
            if self.with_worker is not None:
                self.after_kill["worker_holder"] = runtime.group.slots[self.with_worker].actor._actor_id


class KillShardAfterMemoryCheckpoint(KillShardAt):
    """As KillShardAt, once the controller has committed a memory checkpoint at `memory_step` or later."""

    def __init__(self, memory_step: int, worker: int) -> None:
        super().__init__(step=0, worker=worker)
        self.memory_step, self.memory_at_kill = memory_step, None

    def after_run(self, context, event):
        latest = context.session.runtime.memory_checkpoints.latest
        if not self.killed_at:
            if latest is None or latest.global_step < self.memory_step:
                self.events.append(event)
                self.data_steps.append(context.session.data_steps)
                return
            self.memory_at_kill, self.memory_model_state = latest.global_step, latest.model_state
            runtime = context.session.runtime
            workers = {slot.actor._actor_id: worker for worker, slot in runtime.group.slots.items()}
            self.worker_holders = [workers.get(holder._actor_id) for holder in latest.holders]
        super().after_run(context, event)


# Two shards hold each other's copies; one shard's copy is held by its warm spare, which takes the
# lost one's place and loads the copy it holds, or, with no spare, by a worker.
@pytest.mark.parametrize("ps, spares", [(1, 0), (1, 1), (2, 0)])
def test_a_lost_parameter_server_rolls_the_shards_back_to_a_memory_checkpoint(
    ray_cluster, blob_data, tmp_path, ps, spares
):
    raw = blob_spec(
        blob_data,
        # batch-norm statistics: the workers' state, asked for with each memory checkpoint
        model={"params": {"input_dim": 8, "num_classes": 2, "hidden": [16], "seed": 1, "batch_norm": True}},
        data={"batch_size": BATCH, "epochs": None},
        # every variable on both shards, where there are two
        cluster={"workers": 2, "ps": ps, "min_slice_bytes": 64, "spare_shards": spares},
        training={
            "max_steps": 80,
            "optimizer": {"name": "adam", "learning_rate": 0.01},
            "failure": {"memory_checkpoint_every_s": 0.5},
        },
        supervision={"checkpoint": {"every_steps": 50}},  # none stored before the loss
    )
    hook = KillShardAfterMemoryCheckpoint(memory_step=15, worker=ps - 1)
    slow = FaultInjector(step_delay_s={0: 0.04, 1: 0.04})
    result = train(validate_spec(raw), hooks=[hook], track=False, output_dir=tmp_path, faults=slow)
    assert hook.killed_at and hook.memory_at_kill is not None
    assert any("moving_variance" in name for name in hook.memory_model_state), hook.memory_model_state
    assert result.global_step == 80
    assert {s["version"] for s in result.shards} == {80}
    (fault,) = hook.faults
    back_to = re.search(r"rolled back to step (\d+) \(a memory checkpoint\)", fault.action)
    assert back_to, fault.action
    step = int(back_to.group(1))
    # the one committed when the kill was decided, or one whose parts were all held before the loss
    assert hook.memory_at_kill <= step <= hook.version_at_kill + 1
    # The survivor reloaded its own copy; the new shard the copy shard 0 (or the spare) held of
    # the lost one's state.
    survivor = [f"its own copy of step {step}"] if ps == 2 else []
    assert [s["loaded_from"] for s in result.shards] == [*survivor, f"a peer's copy of step {step}"]
    if spares:  # the spare that held the copy took the place
        assert fault.action.endswith("a warm spare in its place"), fault.action
        assert hook.after_kill["shard_pid"] == hook.spare_pids[0]
    # the copy's holder: a worker only where there is no other shard or spare to hold it
    assert hook.worker_holders == ([0] if ps == 1 and not spares else [None] * ps), hook.worker_holders
    assert 0 <= hook.metrics["steps_redone"] <= hook.version_at_kill + 1 - step
    assert _falls([e.loss for e in hook.events])
    assert all(np.isfinite(p).all() for p in result.parameters)


# Async, with a spare shard and a spare worker, and worker 1 lost with shard 1, as on a node's loss
# (the spares take both places in the rollback). A new shard (no spare), in sync, is the memory
# checkpoint's test's; a shard reading its part from the store, this one's spare and a resumed run's.
def test_a_lost_parameter_server_rolls_every_shard_back_to_the_last_checkpoint(
    ray_cluster, blob_data, tmp_path
):
    raw = blob_spec(
        blob_data,
        data={"batch_size": BATCH, "epochs": None},
        # every variable on both shards
        cluster={
            "workers": 2,
            "ps": 2,
            "min_slice_bytes": 64,
            "spare_shards": 1,
            "spare_workers": 1,
        },
        training={
            "mode": "async",
            "max_steps": 80,
            "optimizer": {"name": "adam", "learning_rate": 0.01},
            "failure": {"memory_checkpoint_every_s": None},  # the stored checkpoint's path
        },
        supervision={"checkpoint": {"every_steps": 10}},
    )
    hook = KillShardAt(step=25, worker=1, with_worker=1)  # shard 1 and worker 1
    # 0.04 s a step: the 55 steps after the kill's step (async: two workers' versions) outlast the
    # chief's lag and the checkpoint at 20.
    slow = FaultInjector(step_delay_s={0: 0.04, 1: 0.04})
    result = train(validate_spec(raw), hooks=[hook], track=False, output_dir=tmp_path, faults=slow)
    assert hook.killed_at
    assert result.global_step == 80
    assert {s["version"] for s in result.shards} == {80}  # one version on every shard, never a mix
    # The survivor reloaded its own copy of the checkpoint it wrote; the spare read the store.
    assert [s["loaded_from"] for s in result.shards] == ["its own copy of step 20", "shard-00001 of step 20"]
    fault = hook.faults[0]
    assert "parameter server 1 lost" in fault.what and "rolled back to step 20" in fault.action
    assert hook.metrics["ps_rollbacks"] == 1
    assert hook.metrics["ps_rollback_s"] > 0
    # The spares took shard 1's and worker 1's places; new spares started in their bundles.
    assert fault.action.endswith("a warm spare in its place")
    assert hook.after_kill["shard_pid"] == hook.spare_pids[0]
    (new_spare,) = hook.after_kill["spare_pids"]
    assert new_spare not in hook.spare_pids
    assert [(f.what.split(" lost")[0], f.action) for f in hook.faults[1:]] == [
        ("worker 1", "replaced by a warm spare, in the rollback")
    ], hook.faults
    assert hook.after_kill["worker_holder"] == hook.spare_workers[0]
    assert hook.metrics["workers_lost"] == 1 and hook.metrics["workers_replaced"] == 1
    # Lost: the steps since the checkpoint at 20, up to where the shards were when one died (the
    # checkpoint at 30 may not exist yet: the chief had heard of step 25 only). Slack: a step applied
    # between the ping and the kill; async: the survivor may lead by a push per worker, and takes
    # one more from each before the workers meet the dead shard.
    slack = 2 * 2
    assert 0 < hook.metrics["steps_redone"] <= hook.version_at_kill + slack - 20
    steps = [e.global_step for e in hook.events]
    assert steps.count(21) == 2  # step 21 was reported, then redone after the rollback
    # The data was planned again from step 20's position, a file partly read then read again: it
    # ends later than first planned, and the progress shown says so.
    assert hook.data_steps[-1] > hook.data_steps[0]
    assert _falls([e.loss for e in hook.events])
    assert all(np.isfinite(p).all() for p in result.parameters)
