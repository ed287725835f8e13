"""tests/multinode.py's LocalCluster: three real nodes, token auth, placement across nodes, a lost node.

Everything reaches Ray through client subprocesses and the dashboard's HTTP API: this process never
calls `ray.init` (another module's in-process Ray may be running).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error

import pytest
from multinode import RAY_CLI, LocalCluster, multinode_cluster_fixture  # noqa: F401

pytestmark = pytest.mark.timeout(300)

# Three actors spread over the nodes; one puts a 1 MB array into its node's object store, an actor on
# another node reads it (a transfer between object stores), and Ray then knows both copies.
SPREAD_CLIENT = """
import json
import time

import numpy as np
import ray

ray.init(logging_level="ERROR", log_to_driver=False)


@ray.remote(num_cpus=1, scheduling_strategy="SPREAD")
class Probe:
    def node(self):
        return ray.get_runtime_context().get_node_id()

    def put(self):
        return [ray.put(np.arange(250_000, dtype=np.int32))]  # in a list: the caller gets the ref

    def total(self, refs):
        return int(ray.get(refs[0]).sum())


probes = [Probe.remote() for _ in range(3)]
nodes = ray.get([p.node.remote() for p in probes])
(ref,) = ray.get(probes[0].put.remote())
total = ray.get(probes[1].total.remote([ref]))
for _ in range(50):  # the reader's node tells the owner of its copy asynchronously
    locations = ray.experimental.get_object_locations([ref])[ref]["node_ids"]
    if nodes[1] in locations:
        break
    time.sleep(0.1)
print(json.dumps({"nodes": nodes, "total": total, "locations": locations}))
"""


def test_the_cluster_has_three_alive_nodes_and_refuses_clients_without_the_token(
    multinode_cluster: LocalCluster,
):
    cluster = multinode_cluster
    ids = [node.node_id for node in cluster.nodes]
    assert len(set(ids)) == 3 and all(ids)
    assert cluster.alive_nodes() == set(ids)
    assert cluster.state_api("/api/version")["ray_version"]
    for token in (None, "0" * 32):  # no Authorization header, a wrong token
        with pytest.raises(urllib.error.HTTPError) as refused:
            cluster.state_api("/api/v0/nodes", token=token)
        assert refused.value.code in (401, 403)
    env = cluster.env()
    assert env["RAY_ADDRESS"] == cluster.address and env["RAY_AUTH_MODE"] == "token"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env
    # The GCS refuses a client with a wrong token, too.
    out = subprocess.run(
        [RAY_CLI, "status"],
        env={**env, "RAY_AUTH_TOKEN": "0" * 32},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "InvalidAuthToken" in out.stdout + out.stderr, out.stdout + out.stderr


def test_spread_actors_land_on_three_nodes_and_read_objects_across_stores(
    multinode_cluster: LocalCluster,
):
    cluster = multinode_cluster
    out = subprocess.run(
        [sys.executable, "-c", SPREAD_CLIENT],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(report["nodes"]) == sorted(cluster.alive_nodes()), report
    assert report["total"] == sum(range(250_000))
    owner, reader = report["nodes"][:2]
    assert {owner, reader} <= set(report["locations"]), report  # a copy on the reader's node too


def test_a_killed_node_is_reported_dead_and_a_new_one_joins(multinode_cluster: LocalCluster):
    cluster = multinode_cluster
    victim = cluster.nodes[-1]
    cluster.kill_node(victim)
    assert victim.process.poll() is not None
    cluster.wait_for_state(victim, "DEAD", timeout=60)
    assert len(cluster.alive_nodes()) == 2 and victim.node_id not in cluster.alive_nodes()

    fresh = cluster.add_node(num_cpus=2)
    assert fresh.node_id != victim.node_id
    assert cluster.alive_nodes() == {n.node_id for n in cluster.nodes if not n.killed}
    assert len(cluster.alive_nodes()) == 3
