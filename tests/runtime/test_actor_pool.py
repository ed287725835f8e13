"""A finished run's actors kept for the next run of the same process (runtime/actor_pool.py), on
the session's Ray: taken by a run of the same placement, which trains as new actors would, those
of a role set up for other TensorFlow settings replaced; ended by a run of another placement and
once their wait runs out."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest
import ray
from support import blob_spec, tracked_spec

from towerflow.errors import TrainingError
from towerflow.launch import train
from towerflow.runtime.actor_pool import release_kept_actors
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook
from towerflow.runtime.run_control import NAMESPACE
from towerflow.spec import validate_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class Processes(Hook):
    """The run's shard and worker processes, as it starts, its variables' names and its placement
    groups, and those its control point keeps."""

    def after_create_session(self, session):
        runtime = session.runtime
        self.shards = ray.get([shard.pid.remote() for shard in runtime.shards])
        self.workers = ray.get([worker.pid.remote() for worker in runtime.workers])
        self.variables = [v.name for v in session.variables]
        self.groups = runtime.actor_placement.group_names()
        self.worker_cpus = runtime.spec.cluster.cpus_per_worker
        control = runtime.control
        self.kept_groups = control and ray.get(control.actor.__ray_call__.remote(lambda c: c._group_names))


def _spec(blob_data, workers=1, keep_actors_s=30, mode="sync", worker_cpus=1):
    return validate_spec(
        blob_spec(
            blob_data,
            data={"batch_size": 32, "epochs": None, "deterministic": True, "shuffle_files": False},
            cluster={
                "workers": workers,
                "ps": 1,
                "keep_actors_s": keep_actors_s,
                "cpus_per_worker": worker_cpus,
            },
            training={"mode": mode, "max_steps": 12, "optimizer": {"name": "sgd", "learning_rate": 0.05}},
        )
    )


def _run(spec, tmp_path, name):
    seen = Processes()
    result = train(spec, hooks=[seen], track=False, output_dir=tmp_path / name)
    assert result.global_step == 12
    return seen, result


def _ended(pids, within_s=30.0):
    deadline = time.monotonic() + within_s
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(psutil.pid_exists(p) for p in pids)


def test_the_next_run_of_the_same_placement_takes_the_last_runs_actors_and_trains_as_new_ones_would(
    ray_cluster, blob_data, tmp_path
):
    release_kept_actors()  # whatever an earlier test's run kept
    # The workers' CPUs sized from the CPUs free on the Ray joined (the session's): the second run
    # counts those the first run's kept actors hold as free, so it asks for the same placement.
    first, trained_new = _run(_spec(blob_data, worker_cpus="auto"), tmp_path, "first")
    second, trained_kept = _run(_spec(blob_data, worker_cpus="auto"), tmp_path, "second")
    assert first.worker_cpus == second.worker_cpus > 1
    assert (second.shards, second.workers) == (first.shards, first.workers)  # the same processes
    # Built anew: the same variable names (checkpoints key on them) and initial weights, so the
    # same data gives the same model.
    assert second.variables == first.variables
    for new, kept in zip(trained_new.parameters, trained_kept.parameters, strict=True):
        np.testing.assert_allclose(kept, new, rtol=1e-5, atol=1e-6)
    # Another placement (two workers) cannot take them: they end, and new processes start.
    third, _ = _run(_spec(blob_data, workers=2), tmp_path, "third")
    assert not set(third.shards + third.workers) & set(first.shards + first.workers)
    assert _ended(first.shards + first.workers)
    # An async run of that placement takes the sync run's workers; its shards, whose threads a
    # sync run's set apart from an async one's at 2 workers, are new, the sync run's ended.
    fourth, _ = _run(_spec(blob_data, workers=2, keep_actors_s=1, mode="async"), tmp_path, "fourth")
    assert fourth.workers == third.workers and not set(fourth.shards) & set(third.shards)
    assert fourth.groups == third.groups and _ended(third.shards)
    # No run took the fourth's within its 1 s: they end.
    assert _ended(fourth.shards + fourth.workers)


def test_a_failed_run_and_one_that_keeps_nothing_leave_no_actors(ray_cluster, blob_data, tmp_path):
    release_kept_actors()
    failed = Processes()
    with pytest.raises(TrainingError, match="loss is nan"):
        train(
            _spec(blob_data),
            hooks=[failed],
            track=False,
            output_dir=tmp_path / "failed",
            faults=FaultInjector(nonfinite_loss={0: (3, None)}),
        )
    assert _ended(failed.shards + failed.workers)  # a failed run's actors are not worth keeping
    unkept, _ = _run(_spec(blob_data, keep_actors_s=0), tmp_path, "unkept")
    assert not set(unkept.shards + unkept.workers) & set(failed.shards + failed.workers)
    assert _ended(unkept.shards + unkept.workers)


def test_a_tracked_run_takes_the_last_tracked_runs_actors_and_its_control_point_keeps_them(
    ray_cluster, blob_data, tmp_path
):
    """A tracked run's actors outlive a lost driver: while they wait, a control point of their own
    keeps them; the run that takes them has its own keep their placement groups."""
    release_kept_actors()
    sections = {
        "data": {"batch_size": 32, "epochs": None},
        "cluster": {"workers": 1, "ps": 1},
        "training": {"max_steps": 6},
    }
    spec, uri = tracked_spec(tmp_path, blob_data, "kept", **sections)
    first, second = Processes(), Processes()
    train(spec, hooks=[first])
    keepers = _control_points()
    assert len(keepers) == 1 and keepers[0].startswith("run-kept-"), keepers  # the run's own ended
    train(spec, hooks=[second])
    assert (second.shards, second.workers) == (first.shards, first.workers)
    assert second.groups == first.groups and tuple(second.kept_groups) == first.groups
    after = _control_points()  # the first keeper ended; the second run's actors have one of their own
    assert len(after) == 1 and after[0].startswith("run-kept-") and after != keepers, after
    release_kept_actors()
    assert _ended(second.shards + second.workers)
    assert _control_points(within_s=30) == []


def _control_points(within_s: float = 0) -> list[str]:
    """The control points alive on the session's Ray: after `within_s`, where some still end."""
    deadline = time.monotonic() + within_s
    while True:
        names = sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE
        )
        if not names or time.monotonic() >= deadline:
            return names
        time.sleep(0.5)
