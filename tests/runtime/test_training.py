"""Training semantics on a real local Ray with real TensorFlow actors.

Tests whose runs have one placement (shards, workers, spares) follow each other: a run takes the
last one's actors where they fit (runtime/actor_pool.py), seconds a test on 2 cores."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient
from sample_hooks import StopAtStepHook
from support import blob_spec, blobs, ray_data_claims, tracked_spec

from models import mlp
from towerflow.runtime.driver import Driver
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook
from towerflow.shared_types import DataFeed
from towerflow.spec import validate_spec


class Recorder(Hook):
    def __init__(self):
        self.calls, self.events, self.outcome = [], [], None

    def begin(self, session):
        self.calls.append("begin")
        self.session = session

    def after_create_session(self, session):
        self.calls.append("after_create_session")

    def after_run(self, context, event):
        self.events.append(event)

    def end(self, session, outcome):
        self.calls.append("end")
        self.outcome = outcome


def _rows(columns, indices):
    return [{k: columns[k][i] for k in ("x", "label")} for i in indices]


def _fixed_splits(ray, columns, per_worker):
    """Each worker gets exactly the rows listed for it, in order (the runtime, not Ray Data, is under test)."""

    def one_split(rows):
        ds = ray.data.from_items(_rows(columns, rows), override_num_blocks=1)
        # Ray Data may hand out batches out of order unless asked to keep it.
        ds.context.execution_options.preserve_order = True
        return ds.iterator()

    def make(num_workers, examples_seen=None, shape=None):
        assert num_workers == len(per_worker)
        return DataFeed([one_split(rows) for rows in per_worker], {})

    return make


def test_hooks_can_stop_the_job_and_its_reads_give_their_cores_back(ray_cluster, blob_data):
    spec = validate_spec(blob_spec(blob_data, data={"epochs": 5}, training={"max_steps": 500}))
    from towerflow.launch import train

    before = ray_data_claims(ray_cluster)
    result = train(spec, hooks=[StopAtStepHook(3)], track=False)
    assert 3 <= result.global_step < 500
    # The stop drains: every shard ends at the same version (the final checkpoint's cut).
    assert {s["version"] for s in result.shards} == {result.global_step}
    # Its stream, 4 epochs from its end, was shut down: no claim left to starve the next job's reads.
    assert ray_data_claims(ray_cluster) <= before


def test_cluster_ps_auto_trains_on_the_shard_count_the_cost_model_picks(ray_cluster, blob_data):
    from towerflow.launch import train
    from towerflow.runtime.shard_count import auto_shards

    model = {"params": {"input_dim": 8, "num_classes": 2, "hidden": [2048, 2048], "seed": 1}}
    spec = validate_spec(
        blob_spec(
            blob_data,
            model=model,
            cluster={"workers": 2, "ps": "auto"},
            training={"max_steps": 3},
        )
    )
    expected = auto_shards(spec)
    assert expected > 1  # a 4.2 M-parameter model with next to no compute per parameter
    result = train(spec, track=False)
    assert result.global_step == 3 and len(result.shards) == expected


def test_async_applies_every_push_and_measures_staleness(ray_cluster, blob_data):
    spec = validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": 16, "epochs": 3},
            cluster={"workers": 2, "ps": 2},
            training={"mode": "async", "max_steps": 60},
        )
    )
    from towerflow.launch import train

    hook = Recorder()
    # The run outlasts several slow steps, also where the slow worker starts a second late.
    delays = FaultInjector(step_delay_s={0: 0.03, 1: 0.15})
    result = train(spec, hooks=[hook], track=False, faults=delays)
    assert result.global_step == 60
    assert [e.global_step for e in hook.events] == list(range(1, 61))
    assert all(len(e.workers) == 1 for e in hook.events)
    assert result.staleness["max"] >= 2  # the slow worker's gradients were several versions old
    assert result.dropped_stale == 0


def test_async_bounded_staleness_rejects_old_gradients(ray_cluster, blob_data):
    spec = validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": 16, "epochs": 3},
            cluster={"workers": 2, "ps": 2},
            training={"mode": "async", "max_steps": 60, "max_staleness": 1},
        )
    )
    from towerflow.launch import train

    delays = FaultInjector(step_delay_s={0: 0.03, 1: 0.15})
    result = train(spec, track=False, faults=delays)
    assert result.global_step == 60
    assert result.staleness["max"] <= 1  # nothing older than the bound was applied
    assert result.shards[0]["stale"] >= 1  # and the slow worker's old gradients were rejected


def test_async_shards_that_dropped_different_gradients_end_at_one_step_and_checkpoint_it(
    ray_cluster, blob_data, tmp_path
):
    """Bounded staleness judges each push at each shard: worker 1's pushes reach shard 0 too late
    (dropped there) and shard 1 in time, so shard 0 falls behind. The run still ends at one step,
    its last checkpoint holds each shard's last state at it, and its metrics end there."""
    spec, uri = tracked_spec(
        tmp_path,
        blob_data,
        "drift",
        data={"batch_size": 16, "epochs": 3},
        cluster={"workers": 2, "ps": 2},
        training={"mode": "async", "max_steps": 30, "max_staleness": 1},
    )
    from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
    from towerflow.checkpoint.stores import latest_step
    from towerflow.launch import train

    # Worker 0 slowed, so that worker 1 takes steps however late it starts (a fresh process traces
    # its step first: worker 0 alone once took all 30 before worker 1's first).
    late_at_shard_0 = FaultInjector(pushes_older_at_shard={1: (0, 5)}, step_delay_s={0: 0.2})
    result = train(spec, faults=late_at_shard_0)
    stale = [shard["stale"] for shard in result.shards]
    assert stale[0] > stale[1]  # worker 1's pushes were dropped at shard 0
    assert [shard["version"] for shard in result.shards] == [30, 30]  # settled at the furthest
    assert result.global_step == 30
    # The steps logged follow shard 0's count, behind: the run's metrics still end at its step.
    client = MlflowClient(uri)
    steps = client.get_metric_history(result.run_id, "global_step")
    assert max(m.step for m in steps) == max(m.value for m in steps) == 30, steps[-3:]
    store = MlflowCheckpointStore(client, result.run_id)
    assert latest_step(store) == 30
    state = store.load(30)
    assert state.global_step == 30 and all(np.isfinite(v).all() for v in state.variables.values())


@pytest.mark.parametrize("push_bucket_bytes", [None, 64], ids=["one-push", "bucketed"])
def test_sync_two_workers_equal_one_process_with_double_batch(ray_cluster, blob_data, push_bucket_bytes):
    """Bucketed: every variable is a bucket of its own, pushed from inside the backward pass."""
    b, k, lr = 8, 6, 0.2
    columns = blobs(2 * b * k, seed=5)
    # Step t: worker 0 sees rows [2tb, 2tb+b), worker 1 rows [2tb+b, 2tb+2b).
    per_worker = [[i for i in range(2 * b * k) if (i // b) % 2 == w] for w in range(2)]
    spec = validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": b},
            # Cut every kernel into row slices on both shards: slices must reassemble exactly.
            cluster={
                "workers": 2,
                "ps": 2,
                "sharding": "round_robin",
                "min_slice_bytes": 64,
                "push_bucket_bytes": push_bucket_bytes,
            },
            training={"mode": "sync", "max_steps": k, "optimizer": {"name": "sgd", "learning_rate": lr}},
        )
    )
    hook = Recorder()
    result = Driver(spec, [hook], _fixed_splits(ray_cluster, columns, per_worker)).run()
    sliced = [p for p in hook.session.pieces if not p.covers(hook.session.variables[p.variable])]
    assert sliced, "the test must exercise sliced variables"
    if push_bucket_bytes:
        assert all(len(s["bucket_versions"]) > 1 for s in result.shards), (
            "every shard must get several pushes"
        )

    assert hook.calls == ["begin", "after_create_session", "end"]
    assert hook.outcome.status == "FINISHED"
    assert result.global_step == k
    assert [e.global_step for e in hook.events] == list(range(1, k + 1))
    assert all(e.workers == [0, 1] for e in hook.events)

    model = mlp.build(**spec.model.params)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for t in range(k):
        xb = columns["x"][2 * t * b : 2 * (t + 1) * b]
        yb = columns["label"][2 * t * b : 2 * (t + 1) * b]
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        for var, grad in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            var.assign_sub(lr * grad)
    assert len(result.parameters) == len(model.trainable_variables)
    for got, want in zip(result.parameters, model.trainable_variables):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5)


@pytest.mark.parametrize("push_bucket_bytes", [None, 64], ids=["one-push", "bucketed"])
def test_sync_backup_worker_gradients_are_dropped_as_stale(ray_cluster, blob_data, push_bucket_bytes):
    """3 workers, 2 to aggregate, worker 2 deliberately slow: steps go at the fast workers' pace.

    Bucketed, each bucket picks its own first two gradients, as each variable's accumulator did.
    """
    spec = validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": 16, "epochs": 3},
            cluster={"workers": 3, "ps": 1, "cpus_per_worker": 1, "push_bucket_bytes": push_bucket_bytes},
            training={"mode": "sync", "max_steps": 20, "replicas_to_aggregate": 2, "total_num_replicas": 3},
        )
    )
    from towerflow.launch import train

    hook = Recorder()
    # Fast workers take >= 50 ms a step, so 20 steps outlast several of the slow worker's 400 ms steps.
    delays = FaultInjector(step_delay_s={0: 0.05, 1: 0.05, 2: 0.4})
    result = train(spec, hooks=[hook], track=False, faults=delays)
    assert result.global_step == 20
    assert [e.global_step for e in hook.events] == list(range(1, 21))
    assert len(result.shards[0]["bucket_versions"]) == (3 if push_bucket_bytes else 1)  # of 4 variables
    assert result.dropped_stale >= 1  # the slow worker computed on versions that had moved on
    assert sum(e.dropped_stale for e in hook.events) <= result.dropped_stale
    slow_steps = next(w["steps"] for w in result.workers if w["worker"] == 2)
    assert slow_steps < 10
    # Nearly every update was made of the two fast workers' gradients (waiting for all three, every
    # one would hold the slow one's). Not none: the first step's, and any where both fast workers
    # stalled on the busy cores past the slow one's step (3 of 20 once, beside another test process).
    assert sum(2 in e.workers for e in hook.events) <= 4
    assert all(len(e.workers) == 2 for e in hook.events)


def test_async_fetch_every_computes_on_held_parameters_and_publishes_only_what_is_fetched(
    ray_cluster, blob_data
):
    """Downpour's n_fetch: one worker taking new parameters every 3rd step computes its gradients
    against versions 0, 1 and 2 updates old in turn; a shard publishes the fetched versions only."""
    spec = validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": 16, "epochs": 3},
            cluster={"workers": 1, "ps": 2},
            training={"mode": "async", "max_steps": 30, "fetch_every": 3},
        )
    )
    from towerflow.launch import train

    hook = Recorder()
    result = train(spec, hooks=[hook], track=False)
    assert result.global_step == 30
    assert [e.global_step for e in hook.events] == list(range(1, 31))
    assert result.staleness["max"] == 2 and result.dropped_stale == 0
    for shard in result.shards:  # the first pull, then every 3rd step's replies
        assert shard["applied"] == 30 and shard["publications"] == 1 + 30 // 3
    assert np.isfinite(result.final_loss) and result.final_loss < hook.events[0].loss


def test_async_overlap_push_computes_each_step_one_push_behind(ray_cluster, blob_data):
    """Downpour's asynchronous push: one worker computes step t on the parameters of the reply to
    push t-2 (push t-1 is still on its way), so w(t+1) = w(t) - lr * g(w(t-1)), and every push but
    the first is one version stale. The kernels are cut across both shards: the rows reassemble.
    A shard, an async actor, could start the later of two pushes in flight first (Ray keeps no
    call order for such an actor; a staleness of 2 was seen once in CI, 2026-12-07): the pushes
    carry their number, and the shards take them in the worker's order (test_ps.py)."""
    b, k, lr = 8, 6, 0.2
    columns = blobs(b * k, seed=7)
    spec = validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": b},
            cluster={"workers": 1, "ps": 2, "sharding": "round_robin", "min_slice_bytes": 64},
            training={
                "mode": "async",
                "max_steps": k,
                "overlap_push": True,
                "optimizer": {"name": "sgd", "learning_rate": lr},
            },
        )
    )
    hook = Recorder()
    result = Driver(spec, [hook], _fixed_splits(ray_cluster, columns, [list(range(b * k))])).run()
    assert result.global_step == k
    assert [e.global_step for e in hook.events] == list(range(1, k + 1))
    assert result.staleness["max"] == 1 and result.dropped_stale == 0
    assert result.workers[0]["steps"] == k and result.workers[0]["examples"] == b * k

    model = mlp.build(**spec.model.params)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    previous = [v.numpy() for v in model.trainable_variables]  # w(t-1); w(-1) = w(0)
    for t in range(k):
        current = [v.numpy() for v in model.trainable_variables]
        for var, value in zip(model.trainable_variables, previous):
            var.assign(value)
        with tf.GradientTape() as tape:
            loss = loss_fn(
                columns["label"][t * b : (t + 1) * b], model(columns["x"][t * b : (t + 1) * b], training=True)
            )
        grads = tape.gradient(loss, model.trainable_variables)
        for var, value, grad in zip(model.trainable_variables, current, grads):
            var.assign(value - lr * grad)
        previous = current
    for got, want in zip(result.parameters, model.trainable_variables):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5)


def test_towers_inside_workers(ray_cluster, blob_data):
    spec = validate_spec(
        blob_spec(blob_data, cluster={"workers": 1, "ps": 1, "towers": 2}, training={"max_steps": 5})
    )
    from towerflow.launch import train

    result = train(spec, track=False)
    assert result.global_step == 5
    assert np.isfinite(result.final_loss)
    (worker,) = result.workers
    assert [d.upper() for d in worker["devices"]] == ["/CPU:0", "/CPU:1"]  # one logical device per tower
    assert worker["gpu_peak_mb"] == {}
