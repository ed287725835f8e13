"""The cost model's arithmetic, and `cluster.ps: auto` resolved from it (no Ray: the model is built here)."""

from __future__ import annotations

import pytest
from support import blob_spec

from towerflow.errors import SpecError
from towerflow.runtime.cost_model import DEFAULT_COSTS, Costs, examples_per_s, predict_step, shards_for
from towerflow.runtime.shard_count import auto_shards, count_parameters, resolve_shards
from towerflow.spec import validate_spec

COSTS = Costs(
    compute_s_per_example=1e-3,
    compute_fixed_s=2e-3,
    compute_cores=1.0,
    worker_s_per_byte=1e-9,
    push_s_per_byte=2e-9,
    apply_s_per_byte=1e-9,
    publish_s_per_byte=1e-9,
    call_s=1e-4,
)
SHAPE = {"params": 1_000_000, "batch_per_worker": 32}


def test_a_sync_step_is_a_workers_part_then_a_shards_and_async_overlaps_the_others_pushes():
    sync = predict_step(COSTS, workers=4, shards=1, mode="sync", **SHAPE)
    async_ = predict_step(COSTS, workers=4, shards=1, mode="async", **SHAPE)
    worker = 2e-3 + 32e-3 + 2 * 4e6 * 1e-9 + 2 * 1e-4
    assert sync.worker_s == pytest.approx(worker)
    assert sync.shard_s == pytest.approx(4 * 4e6 * 2e-9 + 4e6 * 2e-9)  # 4 pushes in, one apply + publish
    assert sync.seconds == pytest.approx(sync.worker_s + sync.shard_s)
    assert async_.shard_s == pytest.approx(4 * 4e6 * 2e-9 + 4 * 4e6 * 2e-9)  # an apply per push
    # Each async worker waits for its own push's apply; the other three workers' pushes overlap.
    assert async_.seconds == pytest.approx(max(async_.worker_s + async_.shard_s / 4, async_.shard_s))
    one = predict_step(COSTS, workers=1, shards=1, mode="async", **SHAPE)
    alone = predict_step(COSTS, workers=1, shards=1, mode="sync", **SHAPE)
    assert one.seconds == pytest.approx(alone.seconds)  # one worker: nobody to overlap with
    assert sync.cpu_bound_s == 0.0  # a machine per process


def test_shards_split_the_shard_part_and_the_network_bounds_it():
    one = predict_step(COSTS, workers=16, shards=1, **SHAPE)
    four = predict_step(COSTS, workers=16, shards=4, **SHAPE)
    assert four.shard_s == pytest.approx(one.shard_s / 4)
    assert one.bottleneck == "shards"
    slow = COSTS.on_network(0.1)  # 100 Mbit/s: 16 workers' 4 MB each way swamp one shard's link
    assert predict_step(slow, workers=16, shards=1, **SHAPE).shard_s == pytest.approx(16 * 4e6 / (0.1e9 / 8))


def test_shared_cores_bound_a_step_by_the_cpu_all_processes_need():
    alone = predict_step(COSTS, workers=4, shards=1, **SHAPE)
    shared = predict_step(COSTS, workers=4, shards=1, cores=1, **SHAPE)
    assert shared.cpu_bound_s > alone.seconds and shared.seconds == shared.cpu_bound_s
    assert shared.bottleneck == "cpu"
    assert predict_step(COSTS, workers=4, shards=1, cores=64, **SHAPE).seconds == pytest.approx(alone.seconds)


def test_workers_sharing_a_machine_compute_slower_by_the_measured_contention():
    from dataclasses import replace

    contended = replace(COSTS, compute_contention=1.5)
    compute = 2e-3 + 32e-3
    for workers, slower in ((1, 0.0), (4, 0.5 * compute)):  # one worker has nobody beside it
        base = predict_step(COSTS, workers=workers, shards=1, cores=64, **SHAPE)
        step = predict_step(contended, workers=workers, shards=1, cores=64, **SHAPE)
        assert step.worker_s == pytest.approx(base.worker_s + slower)
    # A machine per worker (no cores given): no neighbour to contend with.
    alone = predict_step(contended, workers=4, shards=1, **SHAPE)
    assert alone.worker_s == pytest.approx(predict_step(COSTS, workers=4, shards=1, **SHAPE).worker_s)


def test_shards_for_picks_the_fewest_within_a_tenth_of_the_best_and_grows_with_workers():
    picked = [shards_for(COSTS, workers=w, **SHAPE) for w in (1, 4, 16)]
    assert picked == sorted(picked) and picked[0] < picked[-1]
    for workers, shards in zip((1, 4, 16), picked):
        steps = {s: predict_step(COSTS, workers=workers, shards=s, **SHAPE).seconds for s in range(1, 65)}
        assert steps[shards] <= 1.1 * min(steps.values())
        if shards > 1:
            assert steps[shards - 1] > 1.1 * min(steps.values())
    assert examples_per_s(COSTS, workers=16, shards=picked[-1], **SHAPE) > examples_per_s(
        COSTS, workers=16, shards=1, **SHAPE
    )


def test_shards_for_stops_where_a_shards_cost_per_push_no_longer_falls_with_more_shards():
    from dataclasses import replace

    # Each shard takes every worker's push: a fixed CPU per push is paid W times whatever S is.
    fixed = replace(COSTS, push_cpu_s=5e-3)
    assert predict_step(fixed, workers=16, shards=64, **SHAPE).shard_s > 16 * 5e-3
    # That floor is most of the step: splitting the bytes further buys less, so fewer shards do.
    assert shards_for(fixed, workers=16, **SHAPE) < shards_for(COSTS, workers=16, **SHAPE)


def test_the_default_costs_are_measured_figures():
    for name in (
        "compute_s_per_example",
        "worker_s_per_byte",
        "push_s_per_byte",
        "apply_s_per_byte",
        "call_s",
    ):
        assert getattr(DEFAULT_COSTS, name) > 0, name


def _wide_spec(tmp_path, workers: int, ps="auto", **cluster):
    model = {"params": {"input_dim": 8, "num_classes": 2, "hidden": [2048, 2048], "seed": 1}}
    return validate_spec(
        blob_spec(
            tmp_path,
            model=model,
            cluster={"workers": workers, "ps": ps, **cluster},
            training={"max_steps": 3},
        )
    )


def test_cluster_ps_auto_counts_the_model_and_picks_more_shards_for_more_workers(tmp_path):
    spec = _wide_spec(tmp_path, 2)
    assert spec.cluster.ps == "auto"
    params, variables = count_parameters(spec.model)
    assert (params, variables) == (8 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 2 + 2, 6)
    resolved = resolve_shards(spec)
    assert resolved.cluster.ps == auto_shards(spec) >= 1
    assert auto_shards(_wide_spec(tmp_path, 64)) > resolved.cluster.ps
    # Without row slices, never more shards than variables.
    assert auto_shards(_wide_spec(tmp_path, 256, min_slice_bytes=None)) <= variables
    assert resolve_shards(_wide_spec(tmp_path, 2, ps=3)).cluster.ps == 3


def test_cluster_ps_takes_a_number_or_auto_only(tmp_path):
    for bad in (0, "many"):
        with pytest.raises(SpecError, match="cluster.ps"):
            validate_spec(blob_spec(tmp_path, cluster={"ps": bad}))


def test_cluster_ps_auto_names_a_model_it_cannot_build(tmp_path):
    spec = validate_spec(blob_spec(tmp_path, model={"params": {"input_dim": -1}}, cluster={"ps": "auto"}))
    with pytest.raises(SpecError, match="cluster.ps: auto .* models.mlp:build"):
        resolve_shards(spec)


def test_gpu_workers_compute_faster_so_auto_gives_them_more_shards(tmp_path):
    cpu = auto_shards(_wide_spec(tmp_path, 8))
    gpu = auto_shards(_wide_spec(tmp_path, 8, gpus_per_worker=1))
    assert gpu >= cpu


def test_the_platforms_own_time_is_on_each_workers_path_and_its_own_cpu_in_the_cpu_bound():
    from dataclasses import replace

    with_overhead = replace(COSTS, overhead_sync_s=0.01, overhead_async_s=0.02)
    with_cpu = replace(COSTS, worker_step_cpu_s=0.01)
    for mode, extra in (("sync", 0.01), ("async", 0.02)):
        plain = predict_step(COSTS, workers=2, shards=1, mode=mode, **SHAPE)
        more = predict_step(with_overhead, workers=2, shards=1, mode=mode, **SHAPE)
        assert more.seconds == pytest.approx(plain.seconds + extra)  # a machine each: on the path
        # Four workers on two cores, bound by the CPU: each worker's own CPU is paid, two a core.
        plain = predict_step(COSTS, workers=4, shards=1, mode=mode, cores=2, **SHAPE)
        more = predict_step(with_cpu, workers=4, shards=1, mode=mode, cores=2, **SHAPE)
        assert plain.bottleneck == more.bottleneck == "cpu"
        assert more.seconds == pytest.approx(plain.seconds + 2 * 0.01)


def test_a_shards_cpu_per_push_counts_once_per_worker():
    from dataclasses import replace

    for mode in ("sync", "async"):
        plain = predict_step(COSTS, workers=4, shards=1, mode=mode, **SHAPE)
        more = predict_step(replace(COSTS, push_cpu_s=1e-3), workers=4, shards=1, mode=mode, **SHAPE)
        assert more.shard_s == pytest.approx(plain.shard_s + 4e-3)


def test_rays_own_processes_add_their_cpu_per_batch_to_the_cores_work():
    from dataclasses import replace

    for mode in ("sync", "async"):
        plain = predict_step(COSTS, workers=4, shards=1, mode=mode, cores=2, **SHAPE)
        busy = predict_step(
            replace(COSTS, other_cpu_s=0.01), workers=4, shards=1, mode=mode, cores=2, **SHAPE
        )
        assert busy.cpu_bound_s == pytest.approx(plain.cpu_bound_s + 0.01 / 2)  # shared by the 2 cores


def test_a_sync_step_on_shared_cores_is_the_workers_cpu_then_the_shards_part():
    # The workers wait for the version while the shard applies: its part does not overlap theirs.
    step = predict_step(COSTS, workers=4, shards=1, mode="sync", cores=2, **SHAPE)
    worker_cpu = 2e-3 + 32e-3 + 2 * 4e6 * 1e-9
    assert step.cpu_bound_s == pytest.approx(4 * worker_cpu / 2 + step.shard_s)


def test_parts_over_rays_inline_limit_cost_a_store_objects_latency_on_the_path_and_the_raylets_cpu():
    from dataclasses import replace

    from towerflow.runtime.cost_model import store_objects

    stored = replace(COSTS, store_object_s=1e-3, store_object_cpu_s=2e-3)
    for mode, on_path, in_all in (("sync", 2, 4 + 1), ("async", 2, 2 * 4)):  # pushes (+ replies / a version)
        objects = store_objects(stored, workers=4, shards=1, params=SHAPE["params"], mode=mode)
        assert (objects.on_path, objects.per_global_batch) == (on_path, in_all)
        step = predict_step(stored, workers=4, shards=1, mode=mode, **SHAPE)
        plain = predict_step(COSTS, workers=4, shards=1, mode=mode, **SHAPE)
        assert step.worker_s == pytest.approx(plain.worker_s + on_path * 1e-3)
        shared = predict_step(stored, workers=4, shards=1, mode=mode, cores=1, **SHAPE)
        assert (
            shared.cpu_bound_s
            >= predict_step(COSTS, workers=4, shards=1, mode=mode, cores=1, **SHAPE).cpu_bound_s
            + in_all * 2e-3
        )
    # Under the limit an async push and its reply travel inside the calls; a sync version is put all the same.
    small = {"params": 10_000, "mode": "sync"}
    assert store_objects(stored, workers=4, shards=1, **small).on_path == 1
    assert store_objects(stored, workers=4, shards=1, **{**small, "mode": "async"}).on_path == 0
    # Enough shards bring each part under the limit (4 MB over 40 shards: 100 kB each).
    assert store_objects(stored, workers=4, shards=40, params=SHAPE["params"], mode="async").on_path == 0
    # Many workers: a shard's node's raylet, 2 objects a push, takes longer than the shard itself.
    many = predict_step(stored, workers=256, shards=1, mode="async", params=50_000, batch_per_worker=32)
    assert many.shard_s == pytest.approx(2 * 256 * 2e-3) and many.bottleneck == "shards"
