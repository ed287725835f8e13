"""tests/multinode.py's LocalCluster: three real nodes, token auth, placement across nodes, a lost node;
and towerflow runs placed over its nodes (cluster.placement), against the same runs on one node.

Everything reaches Ray through client subprocesses and the dashboard's HTTP API: this process never
calls `ray.init` (another module's in-process Ray may be running).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient
from multinode import RAY_CLI, LocalCluster, cluster_spec_file, multinode_cluster_fixture  # noqa: F401

from towerflow.checkpoint.stores import MlflowCheckpointStore

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


STEPS = 20


def _train_on(cluster: LocalCluster, blob_data: Path, tmp_path: Path, name: str, mode: str, placement: str):
    """`python -m towerflow train` of a 2-worker, 2-shard run on the cluster, as a user runs it;
    returns its loss curve."""
    spec, uri = cluster_spec_file(
        tmp_path,
        blob_data,
        name,
        # small reservations: strict_pack puts all four actors on one 2-CPU node
        cluster={
            "workers": 2,
            "ps": 2,
            "cpus_per_worker": 0.5,
            "cpus_per_ps": 0.25,
            "data_cpus": 0.5,
            "placement": placement,
            "min_slice_bytes": 64,
        },
        training={"mode": mode, "max_steps": STEPS, "optimizer": {"name": "sgd", "learning_rate": 0.1}},
        supervision={"checkpoint": {"every_steps": 10}, "log_every_steps": 1},
    )
    done = subprocess.run(
        [sys.executable, "-m", "towerflow", "train", str(spec), "--no-progress"],
        cwd=REPO,
        env={**cluster.env(), "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == STEPS
    store = MlflowCheckpointStore(client, run.info.run_id)  # each shard wrote its part from its node
    assert [p.name for p in store.open(STEPS).parts] == ["shard-00000", "shard-00001"]
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    return [m.value for m in history]


def _nodes_of_run(cluster: LocalCluster, name: str) -> dict[str, list[str]]:
    """Node ids of the run's shards and workers: the actors of its placement group (state API)."""
    groups = cluster.state_api("/api/v0/placement_groups?limit=1000&detail=true")["data"]["result"]["result"]
    (group,) = [g for g in groups if g["name"].startswith(f"towerflow-{name}-")]
    actors = cluster.state_api("/api/v0/actors?limit=1000&detail=true")["data"]["result"]["result"]
    found: dict[str, list[str]] = {"ParameterShard": [], "TowerWorker": []}
    for actor in actors:
        if actor.get("placement_group_id") == group["placement_group_id"] and actor["class_name"] in found:
            found[actor["class_name"]].append(actor["node_id"])
    return found


@pytest.fixture(scope="module")
def one_node_losses(multinode_cluster: LocalCluster, blob_data, tmp_path_factory) -> list[float]:
    """The reference: the same sync run with every actor on one node (strict_pack)."""
    losses = _train_on(
        multinode_cluster, blob_data, tmp_path_factory.mktemp("packed"), "packed", "sync", "strict_pack"
    )
    packed = _nodes_of_run(multinode_cluster, "packed")
    assert len(packed["ParameterShard"]) == len(packed["TowerWorker"]) == 2, packed
    assert len(set(packed["ParameterShard"] + packed["TowerWorker"])) == 1, packed
    return losses


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_runs_spread_over_nodes_train_as_a_one_node_run_does(
    multinode_cluster: LocalCluster, blob_data, tmp_path, one_node_losses, mode
):
    """Shards and workers on different nodes (tensors cross object stores), each shard writing its
    own checkpoint part from its node; the loss curve matches the sync run packed onto one node."""
    cluster = multinode_cluster
    apart = _train_on(cluster, blob_data, tmp_path, f"spread-{mode}", mode, "spread")
    spread = _nodes_of_run(cluster, f"spread-{mode}")
    assert len(spread["ParameterShard"]) == 2 and len(spread["TowerWorker"]) == 2, spread
    assert len(set(spread["ParameterShard"] + spread["TowerWorker"])) == 3, spread  # every node used
    assert set(spread["TowerWorker"]) - set(spread["ParameterShard"]), spread  # a worker away from a shard
    assert len(apart) == len(one_node_losses) == STEPS
    for losses in (apart, one_node_losses):
        assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5]), losses  # it learns
    # Same spec and seed: the curves differ only by which batches met in a step (and, async, by
    # staleness), well within this.
    assert np.mean(apart[-10:]) == pytest.approx(np.mean(one_node_losses[-10:]), rel=0.25, abs=0.05)


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
