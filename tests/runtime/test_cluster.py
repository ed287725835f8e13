"""Connecting to Ray or starting it: an embedded Ray stays on 127.0.0.1 (the CLI's own run of it is
tested in tests/cli) and keeps idle workers as every towerflow node does, a caller that imported Ray
too early is told so, and a RAY_ADDRESS where nothing listens fails at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from multinode_clients import IDLE_WORKER_CLIENT

from towerflow.errors import ClusterError
from towerflow.runtime.cluster import SINGLE_MACHINE_SWITCH, check_reachable

_SHOW_SWITCH = (
    "import os; from towerflow.runtime.cluster import keep_embedded_ray_local as keep; keep(); "
    f"print(os.environ.get({SINGLE_MACHINE_SWITCH!r}))"
)


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", SINGLE_MACHINE_SWITCH)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env={**clean, **env}, capture_output=True, text=True, timeout=240
    )


def test_the_switch_is_set_for_an_embedded_ray_only():
    assert _python(_SHOW_SWITCH).stdout.strip() == "0"
    # Joining a cluster needs this node's real address: leave Ray's default alone.
    assert _python(_SHOW_SWITCH, RAY_ADDRESS="10.0.0.1:6379").stdout.strip() == "None"
    # Too late once Ray is imported (it read the switch then): leave it alone too.
    assert _python("import ray; " + _SHOW_SWITCH).stdout.strip() == "None"


def test_an_embedded_ray_keeps_an_idle_task_worker_for_the_next_task():
    out = _python(IDLE_WORKER_CLIENT, "embedded")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["kept"] and report["second"] == report["first"], report


def test_an_embedded_ray_started_after_ray_was_imported_warns():
    out = _python(
        "import ray\n"
        "from towerflow.runtime.cluster import ResourceBudget, ensure_ray\n"
        "print(ensure_ray(ResourceBudget(0, 0, 0, 0)))\n"
        "ray.shutdown()\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "embedded"
    assert "the embedded Ray listens on" in out.stderr  # a warning: Python shows it unasked
    assert f"set {SINGLE_MACHINE_SWITCH}=0" in out.stderr


def test_an_address_where_nothing_listens_fails_at_once_naming_it():
    # ray.init would retry it for ever; a listening port passes (what answers there is Ray's to judge).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]  # bound, not listening: refuses connections
        with pytest.raises(
            ClusterError, match=rf"no Ray cluster answers at RAY_ADDRESS=127.0.0.1:{port}.*refused"
        ):
            check_reachable(f"127.0.0.1:{port}", timeout_s=5)
        taken.listen()
        check_reachable(f"127.0.0.1:{port}", timeout_s=5)
    with pytest.raises(ClusterError, match="RAY_ADDRESS=nohost.invalid:6379"):
        check_reachable("nohost.invalid:6379", timeout_s=5)
    check_reachable("ray://nohost.invalid:10001")  # Ray Client: left to Ray


def test_a_worker_bigger_than_any_node_fails_up_front_naming_it():
    from towerflow.runtime.cluster import check_actors_fit_nodes
    from towerflow.spec.schema import ClusterSpec

    nodes = [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 4.0, "GPU": 1.0}]  # 8 CPUs in all, 4 at most on one
    check_actors_fit_nodes(ClusterSpec(workers=2, cpus_per_worker=4, gpus_per_worker=1), nodes)
    with pytest.raises(ClusterError, match=r"a worker asks for 6 CPU.*the largest: 4 CPU, 1 GPU over 3 node"):
        check_actors_fit_nodes(ClusterSpec(workers=1, cpus_per_worker=6), nodes)
    with pytest.raises(ClusterError, match=r"a worker asks for 1 CPU, 2 GPU \(cluster.cpus_per_worker"):
        check_actors_fit_nodes(ClusterSpec(workers=1, cpus_per_worker=1, gpus_per_worker=2, towers=2), nodes)
    with pytest.raises(ClusterError, match=r"a parameter server asks for 5 CPU"):
        check_actors_fit_nodes(ClusterSpec(cpus_per_worker=1, cpus_per_ps=5), nodes)
