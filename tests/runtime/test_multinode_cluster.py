"""Towerflow on a real multi-node Ray cluster (tests/multinode.py's LocalCluster, one per module: this
module, test_multinode_driver_loss.py and test_multinode_draining.py hold every test that needs one). The cluster itself: three real nodes, token auth, placement
across nodes, a lost node, the strict placements. Runs spread over its nodes against the same
training in one process. Faults, the driver run as users run it (`python -m towerflow train` with
RAY_ADDRESS): a node holding a worker, or a shard, is lost (its raylet killed); a node that cannot
see the data fails the run as it starts. An elastic run's growth and shrinking on a cluster are
test_multinode_draining.py's, in one run with a draining node. A lost driver is
test_multinode_driver_loss.py's (a cluster of its own).

Everything reaches Ray through client subprocesses and the dashboard's HTTP API: this process never
calls `ray.init` (another module's in-process Ray may be running).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient
from multinode import (  # noqa: F401
    RAY_CLI,
    LocalCluster,
    cluster_spec_file,
    multinode_cluster_fixture,
)
from multinode_clients import IDLE_WORKER_CLIENT, PLACEMENT_CLIENT, SPREAD_CLIENT, WARM_READER_CLIENT
from multinode_drivers import (
    alive_actors,
    client_report,
    finish,
    node_held,
    nodes_with_a_worker_and_no_shard,
    spec_file,
    start_driver,
    wait_for_step,
)
from node_processes import can_hide_folders, raylet_of

from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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
    report = client_report(cluster, SPREAD_CLIENT)
    assert sorted(report["nodes"]) == sorted(cluster.alive_nodes()), report
    assert report["total"] == sum(range(250_000))
    owner, reader = report["nodes"][:2]
    assert {owner, reader} <= set(report["locations"]), report  # a copy on the reader's node too


def test_a_node_full_of_actors_keeps_an_idle_task_worker_for_the_next_task(multinode_cluster: LocalCluster):
    # Ray's default kills it after 1 s, and each of a run's Ray Data read tasks then started a new
    # process importing TensorFlow (docs/cluster.md): RAY_NODE_ENV on every node towerflow starts.
    report = client_report(multinode_cluster, IDLE_WORKER_CLIENT, multinode_cluster.nodes[1].node_id)
    assert report["kept"] and report["second"] == report["first"], report


STEPS = 20


def _train_on(cluster: LocalCluster, blob_data: Path, tmp_path: Path, name: str, mode: str):
    """`python -m towerflow train` of a 2-worker, 2-shard run on the cluster, as a user runs it;
    returns its loss curve."""
    spec, uri = cluster_spec_file(
        tmp_path,
        blob_data,
        name,
        # small reservations, spread: Ray puts shards and workers on every node
        cluster={
            "workers": 2,
            "ps": 2,
            "cpus_per_worker": 0.5,
            "cpus_per_ps": 0.25,
            "data_cpus": 0.5,
            "placement": "spread",
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
    """Node ids of the run's shards, workers and read tasks: the actors of its placement groups, the
    tasks of their job that read files (state API)."""
    groups = cluster.state_api("/api/v0/placement_groups?limit=1000&detail=true")["data"]["result"]["result"]
    group_ids = {g["placement_group_id"] for g in groups if g["name"].startswith(f"towerflow-{name}-")}
    actors = cluster.state_api("/api/v0/actors?limit=1000&detail=true")["data"]["result"]["result"]
    found: dict[str, list[str]] = {"ParameterShard": [], "TowerWorker": [], "reads": []}
    jobs = set()
    for actor in actors:
        if actor.get("placement_group_id") in group_ids and actor["class_name"] in found:
            found[actor["class_name"]].append(actor["node_id"])
            jobs.add(actor["job_id"])
    tasks = cluster.state_api("/api/v0/tasks?limit=10000&detail=true")["data"]["result"]["result"]
    # Where the reads ran: a read task the run's end cancelled before Ray placed it has no node.
    reads = [t for t in tasks if t["job_id"] in jobs and "read_files" in t["name"]]
    found["reads"] = [t["node_id"] for t in reads if t["node_id"] is not None]
    return found


def test_strict_placements_pack_onto_one_node_and_spread_over_all(multinode_cluster: LocalCluster):
    nodes = client_report(multinode_cluster, PLACEMENT_CLIENT)
    # spread: the shards on two nodes (in one group with the workers, Ray stacked them on one)
    assert len(nodes["spread"]) == 4 and len(set(nodes["spread"][:2])) == 2, nodes
    assert len(nodes["strict_pack"]) == 4 and len(set(nodes["strict_pack"])) == 1, nodes
    assert sorted(set(nodes["strict_spread"])) == sorted(multinode_cluster.alive_nodes()), nodes


@pytest.fixture(scope="module")
def one_process_losses() -> list[float]:
    """The reference: the same model, optimizer and global batch (2 workers x 16), trained in this
    process on the blob data's examples in file order, one loss per step as a run logs it."""
    import keras
    import tensorflow as tf
    from support import blobs

    from models import mlp

    columns = blobs(1024)  # blob_data's examples
    model = mlp.build(input_dim=8, num_classes=2, hidden=[16], seed=1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses, batch = [], 32
    for t in range(STEPS):
        xb, yb = columns["x"][t * batch : (t + 1) * batch], columns["label"][t * batch : (t + 1) * batch]
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        for var, grad in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            var.assign_sub(0.1 * grad)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_runs_spread_over_nodes_train_as_one_process_does(
    multinode_cluster: LocalCluster, blob_data, tmp_path, one_process_losses, mode
):
    """Shards and workers on different nodes (tensors cross object stores), each shard writing its
    own checkpoint part from its node; the loss curve matches the same training in one process."""
    cluster = multinode_cluster
    apart = _train_on(cluster, blob_data, tmp_path, f"spread-{mode}", mode)
    spread = _nodes_of_run(cluster, f"spread-{mode}")
    assert len(spread["ParameterShard"]) == 2 and len(spread["TowerWorker"]) == 2, spread
    assert len(set(spread["ParameterShard"] + spread["TowerWorker"])) == 3, spread  # every node used
    assert set(spread["TowerWorker"]) - set(spread["ParameterShard"]), spread  # a worker away from a shard
    # One read at a time (data_cpus 0.5): on one node, which imported TensorFlow for it, not on each
    assert spread["reads"] and len(set(spread["reads"])) == 1, spread
    assert len(apart) == len(one_process_losses) == STEPS
    for losses in (apart, one_process_losses):
        assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5]), losses  # it learns
    if mode == "sync":
        # Same spec and seed: the curves differ only by which batches met in a step, well within this.
        assert np.mean(apart[-10:]) == pytest.approx(np.mean(one_process_losses[-10:]), rel=0.25, abs=0.05)
    else:
        # An async step is one worker's push: by step k it has seen the examples of sync step k/2 (two
        # workers) in k updates, so its loss lies between sync's at k/2 and at k; staleness adds noise.
        seen_alike = np.mean(one_process_losses[STEPS // 4 : STEPS // 2])
        assert np.mean(apart[-10:]) <= 1.25 * seen_alike + 0.05, (apart, one_process_losses)


def test_a_killed_node_is_reported_dead_and_a_new_one_joins(multinode_cluster: LocalCluster):
    cluster = multinode_cluster
    victim = cluster.nodes[-1]
    assert cluster.unasked_losses() == []
    raylet_of(victim.process.pid).kill()  # a loss the test did not ask for: a failed test reports it
    cluster.wait_for_state(victim, "DEAD", timeout=60)
    (report,) = cluster.unasked_losses()
    assert report.startswith(victim.name) and "raylet.out" in report, report
    cluster.kill_node(victim)  # the rest of its processes, as asked
    assert victim.process.poll() is not None and cluster.unasked_losses() == []
    assert len(cluster.alive_nodes()) == 2 and victim.node_id not in cluster.alive_nodes()

    fresh = cluster.add_node(num_cpus=2)
    assert fresh.node_id != victim.node_id
    assert cluster.alive_nodes() == {n.node_id for n in cluster.nodes if not n.killed}
    assert len(cluster.alive_nodes()) == 3

    # Lost unasked again: `heal`, which every test's set-up calls, puts a new node in its place.
    victim, count = cluster.nodes[1], len(cluster.nodes)
    raylet_of(victim.process.pid).kill()
    cluster.wait_for_state(victim, "DEAD", timeout=60)
    (report,) = cluster.heal()
    assert report.startswith(victim.name), report
    assert len(cluster.nodes) == count and victim not in cluster.nodes
    assert cluster.unasked_losses() == [] and len(cluster.alive_nodes()) == 3


def test_a_lost_node_costs_its_worker_which_a_new_node_takes_over(multinode_cluster, blob_data, tmp_path):
    cluster = multinode_cluster
    # Steps enough to outlast the kill in a fast hour (MLflow shows step 20 up to 2 s late).
    spec, uri = spec_file(tmp_path, blob_data, "node-loss", max_steps=600)
    driver = start_driver(cluster, spec)
    run_id = wait_for_step(uri, "node-loss", 20, driver)
    victims = nodes_with_a_worker_and_no_shard(cluster)
    if not victims:
        driver.kill()
        pytest.skip(
            f"Ray placed no worker apart from the shards and the head: {json.dumps(alive_actors(cluster, 'TowerWorker'))}"
        )
    cluster.kill_node(victims[0])  # the nodes left have room for the replacement
    out = finish(driver)
    assert "worker" in out and "replaced" in out
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["global_step"] == 600
    faults = {k: v for k, v in run.data.tags.items() if k.startswith("towerflow.fault.")}
    assert run.data.metrics["workers_lost"] == 1, (
        faults,
        out[-3000:],
    )  # its replacement waited for a live node
    assert any("replaced" in v for v in faults.values()), faults


def test_a_lost_node_with_a_lone_shard_rolls_it_back_to_a_workers_copy_and_the_run_finishes(
    multinode_cluster, blob_data, tmp_path
):
    """The lost node's shard (and its worker, where it had one) are found in the same turn; the
    shard's replacement, if Ray placed it on the dying node, is placed again, and loads the copy of
    the lost shard's state that a worker held on another node (a memory checkpoint); the run goes
    on. (Two shards holding each other's copies: test_multinode_draining.py's drained node.)"""
    cluster = multinode_cluster
    cluster.add_node(num_cpus=2)  # room for what the lost node held, beside the run
    # The shards and two workers spread over the nodes.
    layout = {"placement": "spread", "ps": 1, "cpus_per_ps": 0.25}
    spec, uri = spec_file(
        tmp_path,
        blob_data,
        "shard-node-loss",
        cluster=layout,
        max_steps=600,
        checkpoint_every=1000,  # none stored before the loss: without the memory ones, back to the start
        failure={"memory_checkpoint_every_s": 1.0},
    )
    # The shard is kept off the head (the node a test cannot lose) while the run places its actors.
    with node_held(cluster, cluster.head):
        driver = start_driver(cluster, spec)
        run_id = wait_for_step(uri, "shard-node-loss", 25, driver)  # past the first memory checkpoints
    shard_nodes = {a["node_id"] for a in alive_actors(cluster, "ParameterShard")}
    worker_nodes = {a["node_id"] for a in alive_actors(cluster, "TowerWorker")}
    victims = [n for n in cluster.nodes if not n.killed and n.node_id in shard_nodes - {cluster.head.node_id}]
    if not victims:
        driver.kill()
        pytest.skip("Ray placed the shards on the head")
    victims.sort(key=lambda n: n.node_id not in worker_nodes)  # a shard's and a worker's node first
    cluster.kill_node(victims[0])
    out = finish(driver)
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == 600, out[-3000:]
    assert run.data.metrics["ps_rollbacks"] == 1, out[-3000:]
    faults = [v for k, v in run.data.tags.items() if k.startswith("towerflow.fault.")]
    # A worker on another node held the copy.
    assert any(v.startswith("parameter server") and "(a memory checkpoint)" in v for v in faults), faults


def test_a_new_node_readied_for_reading_runs_its_first_read_task_without_starting_a_process(
    multinode_cluster: LocalCluster,
):
    # Before a spare joins, its node readies a process for the next pipeline's read tasks: on a node
    # with none idle, the first read task started one and imported TensorFlow while every sync worker
    # waited for its first batch (most of the pause after an elastic grow, docs/reliability.md).
    node = multinode_cluster.add_node(num_cpus=2)
    try:
        report = client_report(multinode_cluster, WARM_READER_CLIENT, node.node_id)
    finally:
        multinode_cluster.kill_node(node)
    assert report["read_pid"] == report["warmed"] and report["tensorflow"], report


@pytest.mark.skipif(
    not can_hide_folders(), reason="hiding a folder from a node takes a mount namespace (root)"
)
def test_a_node_that_cannot_see_the_data_fails_the_run_at_its_start_naming_the_node_and_file(
    multinode_cluster, blob_data, tmp_path
):
    """A node without the data (no shared disk; the files on the other nodes only) would fail a
    read task sent there mid-run, or never get one while the driver's node has room (this run
    finished before the check); the run fails at its start instead, naming the node and a file."""
    cluster = multinode_cluster
    blind = cluster.add_node(num_cpus=2, hidden=[str(blob_data)])
    try:
        spec, uri = spec_file(tmp_path, blob_data, "unseen-data", max_steps=40)
        driver = start_driver(cluster, spec)
        out, _ = driver.communicate(timeout=300)
    finally:
        cluster.kill_node(blind)
    assert driver.returncode != 0, out[-3000:]
    first = sorted(str(p) for p in blob_data.glob("train-*"))[0]
    said = re.search(
        rf"data\.train\.paths: node \S+ \(Ray node {blind.node_id[:12]}\) lacks 4 of the 4 files, e\.g\. {re.escape(first)}\. ",
        out,
    )
    assert said, out[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("unseen-data").experiment_id])
    assert run.info.status == "FAILED" and said.group(0) in run.data.tags["towerflow.error"], run.data.tags
    assert not client.get_metric_history(run.info.run_id, "loss")  # failed before any step
