"""Elastic workers on the session's Ray: a running job shrinks and grows when `towerflow scale`
asks (through the run's control actor), without restarting its shards. Nodes joining and leaving
are in test_multinode_draining.py (multi-node)."""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from support import blob_spec, ray_actors, sqlite_store, write_manifest, write_uneven_shards

from towerflow.launch import train
from towerflow.runtime.elastic import ElasticPolicy, workers_that_fit
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook
from towerflow.runtime.run_control import request_scale
from towerflow.spec import validate_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class ScaleAt(Hook):
    """Asks for `count` workers when the chief hears of `step`, for each (step, count) given; with
    `stop_after` (workers, steps), stops the run once that many steps were those workers'."""

    def __init__(self, plan: list[tuple[int, int]], stop_after: tuple[list[int], int] | None = None) -> None:
        self.plan, self.events, self.asked_at = list(plan), [], []
        self.stop_after = stop_after

    def after_run(self, context, event):
        self.events.append(event)
        if self.plan and event.global_step >= self.plan[0][0]:
            _, count = self.plan.pop(0)
            request_scale(context.session.tags["run_id"], count)
            self.asked_at.append(event)
        if self.stop_after is not None:
            workers, steps = self.stop_after
            if sum(e.workers == workers for e in self.events) >= steps:
                context.request_stop(f"{steps} steps of workers {workers}")


def test_scale_shrinks_then_grows_a_running_sync_run_without_restarting_its_shards(
    ray_cluster, blob_data, tmp_path
):
    uri = sqlite_store(tmp_path)
    raw = blob_spec(
        blob_data,
        data={"batch_size": 16, "epochs": None},
        # Two reads at a time: Ray Data spreads them over the nodes, so a spare's node readies a reader.
        cluster={"workers": {"min": 1, "max": 2}, "ps": 1, "data_cpus": 2},
        training={"mode": "sync", "max_steps": 1000, "optimizer": {"name": "sgd", "learning_rate": 0.05}},
        tracking={"tracking_uri": uri, "experiment": "elastic"},
    )
    # It stops 20 steps after the spare (asked for at step 25) joined: 10-20 s after the ask.
    hook = ScaleAt([(10, 1), (25, 2)], stop_after=([0, 2], 20))
    slow = FaultInjector(step_delay_s={w: 0.15 for w in range(4)})
    result = train(validate_spec(raw), hooks=[hook], output_dir=tmp_path, faults=slow)

    assert 45 < result.global_step < 1000
    steps = [e.global_step for e in hook.events]
    assert steps == list(range(1, result.global_step + 1)), (
        "every step reported once, in order, across both resizes"
    )
    assert hook.events[5].workers == [0, 1]
    alone = [e for e in hook.events if e.workers == [0]]
    # Within a few steps (4-5 seen): the driver reads the count between steps, without waiting, and
    # resizes at the next step's end. Counted in steps, not seconds: a step's time moves with the hour
    # and with what runs beside the test.
    assert alone and alone[0].global_step - hook.asked_at[0].global_step <= 8, (
        "worker 1 left soon after the ask"
    )
    grown = [e for e in hook.events if e.workers == [0, 2]]
    assert grown and grown[0].global_step > alone[-1].global_step, "a new worker (id 2) joined later"
    # The spare traced its step while worker 0 trained on, not in its first step after joining,
    # and worker 0 kept its traced step through both resizes.
    traces = {w["worker"]: w["traces"] for w in result.workers}  # in each worker's last run
    assert traces[2] == 0 and traces[0] == 0, traces
    # and, as it started, had its node ready a process for the read tasks of the pipeline it joined
    readied = {w["worker"]: w["node_readied_for_reading"] for w in result.workers}
    assert readied == {0: False, 1: False, 2: True}, readied
    # One shard process, loaded once, all along: its counters cover every step.
    assert result.shards[0]["applied"] == result.global_step
    history = MlflowClient(uri).get_metric_history(result.run_id, "workers")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [2.0, 1.0, 2.0]
    losses = [e.loss for e in hook.events]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


def _shards_with_bad_records_in_the_first(folder: Path, files: int, per_file: int, bad: list[int]) -> None:
    """`files` TFRecord shards of blob-like examples, a manifest with their counts (so a re-planned
    stream starts past the files trained on), and records `bad` of the first lacking their x."""
    paths = write_uneven_shards(folder, [per_file] * files, dim=8, without_x=bad)
    write_manifest(folder, "blobs", [p.name for p in paths], [per_file] * files, dim=8)


def test_a_resize_keeps_the_counts_of_records_skipped_before_it(ray_cluster, tmp_path, caplog):
    """`on_bad_record: skip`: the resize's new pipeline starts past the files trained on, so it never
    reads the first file's bad records again; the run's one ledger still has them at the end."""
    data = tmp_path / "data"
    data.mkdir()
    _shards_with_bad_records_in_the_first(data, files=16, per_file=128, bad=[3, 40])
    uri = sqlite_store(tmp_path)
    raw = blob_spec(
        data,
        data={"batch_size": 16, "epochs": 1, "on_bad_record": "skip", "drop_remainder": False},
        cluster={"workers": {"min": 1, "max": 2}, "ps": 1},
        training={"mode": "sync", "max_steps": 1000},
        tracking={"tracking_uri": uri, "experiment": "elastic-skip"},
    )
    ledgers = {a["ActorID"] for a in ray_actors("SkippedRecordsLedger")}
    hook = ScaleAt([(9, 1)])  # 288 examples trained: the first file (128) is behind the stream
    # Worker 1 (the one to leave) holds each sync step of two: the resize lands before the data
    # ends (64 such steps), also in a slow hour; worker 0 alone then trains on at full speed.
    slow = FaultInjector(step_delay_s={1: 0.4})
    with caplog.at_level(logging.INFO, logger="towerflow"):
        result = train(validate_spec(raw), hooks=[hook], output_dir=tmp_path, faults=slow)

    assert [e for e in hook.events if e.workers == [0]], "the run shrank to one worker"
    resumed = re.search(r"data resumes in epoch 1 of 1, after (\d+) file\(s\)", caplog.text)
    assert resumed and int(resumed[1]) >= 1, "the resize's stream starts past the first file"
    metrics = MlflowClient(uri).get_run(result.run_id).data.metrics
    assert metrics["bad_records_skipped"] == 2
    assert metrics["bad_records_skipped/train-00000-of-00016"] == 2
    assert len({a["ActorID"] for a in ray_actors("SkippedRecordsLedger")} - ledgers) == 1


class KillWorkerAt(Hook):
    """SIGKILLs worker `worker`'s process when the chief hears of `step`."""

    def __init__(self, step: int, worker: int) -> None:
        self.step, self.worker, self.events, self.faults = step, worker, [], []
        self.killed_at: float | None = None

    def after_run(self, context, event):
        self.events.append(event)
        if self.killed_at is None and event.global_step >= self.step:
            import ray

            actor = context.session.runtime.group.slots[self.worker].actor
            os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
            self.killed_at = event.elapsed_s

    def on_fault(self, event):
        self.faults.append(event)


def test_a_sync_elastic_run_shrinks_at_once_when_a_worker_dies_mid_step(ray_cluster, blob_data, tmp_path):
    """The survivors wait in their sync step for the lost worker's gradient: the shards must step
    without it before the resize asks them to stop (else they wait for worker_timeout_s)."""
    raw = blob_spec(
        blob_data,
        data={"batch_size": 16, "epochs": None},
        cluster={"workers": {"min": 1, "max": 2}, "ps": 1},
        training={
            "mode": "sync",
            "max_steps": 60,
            "optimizer": {"name": "sgd", "learning_rate": 0.05},
            "failure": {"worker_timeout_s": 250},
        },
    )
    hook = KillWorkerAt(step=15, worker=1)
    slow = FaultInjector(step_delay_s={0: 0.05, 1: 0.3})  # worker 0 waits in each step for worker 1
    result = train(validate_spec(raw), hooks=[hook], track=False, output_dir=tmp_path, faults=slow)

    assert result.global_step == 60
    (fault,) = hook.faults
    assert "worker 1 lost" in fault.what and "went on without it" in fault.action
    after = [e for e in hook.events if e.workers == [0]]
    assert after, "worker 0 trained on alone"
    assert after[0].elapsed_s - hook.killed_at < 30, "the resize did not wait for worker_timeout_s"


def test_the_elastic_rule_keeps_the_backup_workers_and_starts_within_the_range():
    spec = validate_spec(
        blob_spec(
            Path("/nowhere"),
            cluster={"workers": {"min": 2, "max": 6}, "ps": 1},
            training={"mode": "sync", "replicas_to_aggregate": 4, "max_steps": 5},
        )
    )
    policy = ElasticPolicy.for_spec(spec)
    assert (policy.fewest, policy.most, policy.backups) == (2, 6, 2)
    assert [policy.replicas_to_aggregate(k) for k in (1, 2, 3, 6)] == [1, 1, 1, 4]
    assert [policy.start_count(room) for room in (0, 3, 9)] == [2, 3, 6]
    assert policy.shrinks_on_loss(2) and not policy.shrinks_on_loss(1)
    policy.scale_to(1)
    assert (policy.fewest, policy.target) == (1, 1)
    policy.scale_to(4)  # back above the spec's min: a loss down to 1 is replaced again, not shrunk to
    assert (policy.fewest, policy.target) == (2, 4) and not policy.shrinks_on_loss(1)
    # 8 CPUs less the shard's 0.5 and Ray Data's 1.0 hold 6 workers of 1 CPU.
    assert workers_that_fit(spec.cluster, {"CPU": 8.0}) == 6


def test_the_policy_asks_for_spares_up_to_the_target_and_lets_the_newest_workers_go():
    policy = ElasticPolicy(fewest=1, most=4)
    assert policy.spares_wanted(running=2, pending=1) == 1
    assert policy.resize([0, 1], started_spares=[5, 6, 7]) == ([], [5, 6])
    assert policy.resize([0, 1, 2, 3], started_spares=[]) is None
    policy.scale_to(2)
    assert policy.spares_wanted(running=3, pending=2) == -3  # withdraw both spares, one worker goes
    assert policy.resize([3, 0, 2], started_spares=[]) == ([3], [])


def test_a_worker_on_a_draining_node_trains_on_until_a_started_spare_takes_its_place():
    policy = ElasticPolicy(fewest=1, most=3)
    assert policy.resize([0, 1, 2], started_spares=[], going=[1]) is None  # no spare yet: it trains on
    assert policy.resize([0, 1, 2], started_spares=[5], going=[1]) == ([1], [5])  # swapped in one resize
    assert policy.resize([0, 1], started_spares=[5, 6], going=[0]) == ([0], [5, 6])  # grown, and swapped
    assert policy.resize([0, 1, 2], started_spares=[5], going=[0, 2]) == ([2], [5])  # one place, the newest
    policy.scale_to(1)
    assert policy.resize([0, 1, 2], started_spares=[], going=[0]) == ([0, 2], [])  # no place for it: at once
