"""`cluster.cpus_per_worker: auto`: each worker's share of an embedded Ray's machine, else 1."""

import logging
import os

import pytest
from support import blob_spec, printed_by_a_fresh_process

from towerflow.runtime.cluster import machine_cores, runs_on_embedded_ray
from towerflow.runtime.worker_cpus import auto_worker_cpus, resolve_worker_cpus
from towerflow.spec import validate_spec
from towerflow.spec.schema import ClusterSpec


def test_auto_is_the_default():
    assert ClusterSpec().cpus_per_worker == "auto"


@pytest.mark.parametrize(
    ("cores", "cluster", "cpus"),
    [
        (16, {"workers": 2, "ps": 2}, 7),  # 16 - 2 x 0.5 - 1 = 14 over 2 workers
        (16, {"workers": 2, "ps": "auto"}, 7),  # a shard count not yet resolved counts as one
        (16, {"workers": 3, "ps": 1, "cpus_per_ps": 2, "data_cpus": 2}, 4),  # 12 over 3
        (64, {"workers": {"min": 2, "max": 8}, "ps": 4}, 7),  # elastic: shared by the most it grows to
        (2, {"workers": 2, "ps": 2}, 1),  # this machine: never under one
        (1, {"workers": 1, "ps": 1}, 1),
    ],
)
def test_workers_share_what_the_shards_and_ray_data_leave(cores, cluster, cpus):
    assert auto_worker_cpus(ClusterSpec(**cluster), cores) == cpus


def _spec(tmp_path, cpus_per_worker="auto"):
    raw = blob_spec(tmp_path, cluster={"workers": 2, "ps": 2, "cpus_per_worker": cpus_per_worker})
    return validate_spec(raw)


def test_an_embedded_ray_gives_workers_the_machine(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="towerflow"):
        resolved = resolve_worker_cpus(_spec(tmp_path), embedded=True)
    assert resolved.cluster.cpus_per_worker == auto_worker_cpus(resolved.cluster, machine_cores())
    assert f"this machine's {machine_cores()} cores" in caplog.text


def test_a_cluster_joined_gets_one_cpu_and_a_line_on_how_to_set_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="towerflow"):
        resolved = resolve_worker_cpus(_spec(tmp_path), embedded=False)
    assert resolved.cluster.cpus_per_worker == 1
    assert "set cluster.cpus_per_worker to about a node's cores" in caplog.text


def test_a_number_asked_for_is_kept(tmp_path):
    assert resolve_worker_cpus(_spec(tmp_path, 3), embedded=True).cluster.cpus_per_worker == 3


def test_a_bad_value_names_the_key(tmp_path):
    from towerflow.errors import SpecError

    for bad in (0, "all"):
        with pytest.raises(SpecError, match="cluster.cpus_per_worker"):
            _spec(tmp_path, bad)


def test_the_job_embeds_ray_unless_told_where_one_is(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import ray

    # This session's Ray, where started, is the tests' own (ray.init), not one towerflow embedded.
    assert runs_on_embedded_ray() is not ray.is_initialized()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert not runs_on_embedded_ray()


def test_a_second_job_on_the_ray_the_first_embedded_still_sizes_its_workers_from_the_machine():
    # `towerflow compare` trains its modes one after another in one process: the second found the
    # first's embedded Ray running, took it for a cluster joined, and gave its workers 1 CPU each
    # (on a 16-core machine, 7 for sync against 1 for async).
    code = (
        "import os; os.environ.pop('RAY_ADDRESS', None)\n"
        "from towerflow.runtime.cluster import ResourceBudget, ensure_ray, runs_on_embedded_ray\n"
        "print(runs_on_embedded_ray(), ensure_ray(ResourceBudget(1, 0.5, 0.5, 0)), runs_on_embedded_ray())\n"
        "import ray; ray.shutdown(); ray.init(num_cpus=1, include_dashboard=False)\n"
        "print(runs_on_embedded_ray())  # a Ray the program started itself: not towerflow's\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    assert printed_by_a_fresh_process(code, env) == ["True embedded True", "False"]
