"""`cluster.cpus_per_worker: auto`: each worker's share of an embedded Ray's machine, or of a joined
cluster's nodes."""

import json
import logging
import os

import pytest
from support import blob_spec, printed_by_a_fresh_process

from towerflow.runtime.cluster import machine_cores, runs_on_embedded_ray
from towerflow.runtime.worker_cpus import auto_worker_cpus, joined_worker_cpus, resolve_worker_cpus
from towerflow.spec import validate_spec
from towerflow.spec.schema import ClusterSpec


def test_auto_is_the_default():
    assert ClusterSpec().cpus_per_worker == "auto"


@pytest.mark.parametrize(
    ("cores", "cluster", "cpus"),
    [
        (16, {"workers": 2, "ps": 2}, 7),  # 16 - 2 x 0.5 - 1 = 14 over 2 workers
        (16, {"workers": 2, "ps": "auto"}, 7),  # a shard count not yet resolved counts as one
        (16, {"workers": 2, "ps": 2, "spare_shards": 2}, 6),  # spares hold theirs: 16 - 4 x 0.5 - 1
        (16, {"workers": 2, "ps": 2, "spare_workers": 1}, 4),  # 14 over 2 workers and the spare
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


_16 = {"CPU": 16.0}


@pytest.mark.parametrize(
    ("cluster", "nodes", "free", "cpus"),
    [
        # each node keeps Ray Data's CPU and its part of the shards: 16 - 1 - 0.5, one worker a node
        ({"workers": 2, "ps": 2}, [_16, _16, _16], 48, 14),
        ({"workers": 2, "ps": 2}, [_16, _16], 32, 14),
        ({"workers": 4, "ps": 2}, [_16, _16], 32, 7),  # two workers a node
        ({"workers": 2, "ps": 2}, [_16, _16], 10, 4),  # other jobs hold CPUs: the job fits in the 10 free
        ({"workers": 2, "ps": 2}, [{"CPU": 0.0}, {"CPU": 4.0}, {"CPU": 4.0}], 8, 2),  # a head of 0 CPUs
        ({"workers": 2, "ps": 2}, [{"CPU": 8.0}], 8, 3),  # one node: (8 - 1 - 1) over 2
        ({"workers": 2, "ps": 2, "placement": "strict_pack"}, [_16, _16, _16], 48, 7),  # all on one node
        ({"workers": 2, "ps": 1, "placement": "strict_spread"}, [_16, _16, _16], 48, 14),
        ({"workers": 2, "ps": 2, "placement": "strict_spread"}, [_16, _16, _16], 48, 1),  # 4 bundles, 3 nodes
        ({"workers": {"min": 1, "max": 4}, "ps": 2}, [_16, _16], 32, 7),  # elastic: the most it grows to
        # GPU workers go where the GPUs are: 8 - 1 - 1 on each GPU node, not the 32 of the CPU node
        (
            {"workers": 2, "ps": 2, "gpus_per_worker": 1},
            [{"CPU": 8.0, "GPU": 1.0}] * 2 + [{"CPU": 32.0}],
            48,
            6,
        ),
        ({"workers": 3, "ps": 1}, [{"CPU": 2.0}] * 3, 6, 1),  # small nodes: never under one
        ({"workers": 2, "ps": 2}, [], 0, 1),
    ],
)
def test_a_cluster_joined_gives_workers_the_most_its_nodes_hold(cluster, nodes, free, cpus):
    assert joined_worker_cpus(ClusterSpec(**cluster), nodes, free) == cpus


def test_a_cluster_joined_is_read_as_it_is_now(tmp_path):
    # A Ray of one 8-CPU node, joined as a program does (its own ray.init): (8 - 2 x 0.5 - 1) / 2 = 3
    # each; with 3 CPUs held by another job, the job keeps within the 5 free: 1 each.
    raw = blob_spec(tmp_path, cluster={"workers": 2, "ps": 2, "cpus_per_worker": "auto"})
    code = (
        "import json, logging, os, sys; os.environ.pop('RAY_ADDRESS', None)\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(message)s')\n"
        "import ray; ray.init(num_cpus=8, include_dashboard=False, logging_level='WARNING')\n"
        "from towerflow.runtime.worker_cpus import resolve_worker_cpus\n"
        "from towerflow.spec import validate_spec\n"
        f"spec = validate_spec(json.loads({json.dumps(json.dumps(raw))}))\n"
        "print(resolve_worker_cpus(spec).cluster.cpus_per_worker)\n"
        "@ray.remote(num_cpus=3)\n"
        "class Other:\n"
        "    def ready(self): return True\n"
        "other = Other.remote(); ray.get(other.ready.remote())\n"
        "print(resolve_worker_cpus(spec).cluster.cpus_per_worker)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    lines = [
        line for line in printed_by_a_fresh_process(code, env) if "auto ->" in line or line[:1].isdigit()
    ]
    assert lines == [
        "cluster.cpus_per_worker: auto -> 3 on the Ray cluster joined (1 node(s): 8 CPUs; 8 CPUs free): the "
        "most that still places 2 workers, the shards and Ray Data's CPUs; set a number to choose",
        "3.0",
        "cluster.cpus_per_worker: auto -> 1 on the Ray cluster joined (1 node(s): 8 CPUs; 5 CPUs free): the "
        "most that still places 2 workers, the shards and Ray Data's CPUs; set a number to choose",
        "1.0",
    ]


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
