"""Nodes that drain before they go, on the multi-node test cluster (tests/multinode.py's
LocalCluster, one for this module): a node holding a shard drained as the autoscaler tells of a
preempted instance (`ray drain-node`), then lost; a node that leaves as a Kubernetes pod's preStop
makes it (`towerflow cluster leave`: SIGTERM to its `ray start`, which drains first); an elastic
run that grows onto a node that joins, has its worker on a draining node replaced ahead by a spare
on another node, shrinks when a node is lost and on `towerflow scale`.

Everything reaches Ray through client subprocesses and the dashboard's HTTP API: this process never
calls `ray.init` (another module's in-process Ray may be running).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient
from multinode import multinode_cluster_fixture  # noqa: F401
from multinode_clients import CONTROL_POINT_CLIENT, DRAIN_WATCH_CLIENT
from multinode_drivers import (
    alive_actors,
    finish,
    spec_file,
    start_driver,
    stop,
    wait_for_fault,
    wait_for_metric,
    wait_for_step,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_draining_node_with_a_shard_hurries_the_memory_checkpoints_so_its_loss_redoes_seconds(
    multinode_cluster, blob_data, tmp_path
):
    """A node holding a shard (and a worker, where Ray put one there) drains (a preempted
    instance's notice, as the autoscaler gives it): the run, which kept no memory checkpoint (every
    600 s), keeps one every 2 s (`memory_checkpoint_draining_s`) until the node goes; its loss
    rolls the shards back to one taken after the notice, the other shard's copy on another node,
    where it went back to the run's start; the shard's replacement is placed again if Ray put it
    on the dying node, and the run finishes."""
    cluster = multinode_cluster
    cluster.add_node(num_cpus=2)  # room for what the drained node held, beside the run
    layout = {"placement": "spread", "ps": 2, "cpus_per_ps": 0.25}
    spec, uri = spec_file(
        tmp_path,
        blob_data,
        "drained",
        cluster=layout,
        max_steps=600,
        checkpoint_every=1000,
        failure={"memory_checkpoint_every_s": 600.0},
    )
    driver = start_driver(cluster, spec)
    run_id = wait_for_step(uri, "drained", 20, driver)
    shard_nodes = {a["node_id"] for a in alive_actors(cluster, "ParameterShard")}
    worker_nodes = {a["node_id"] for a in alive_actors(cluster, "TowerWorker")}
    victims = [n for n in cluster.nodes if not n.killed and n.node_id in shard_nodes - {cluster.head.node_id}]
    if not victims:
        driver.kill()
        pytest.skip("Ray placed the shards on the head")
    victims.sort(key=lambda n: n.node_id not in worker_nodes)  # a shard's and a worker's node first
    cluster.drain_node(victims[0], deadline_s=30)
    told = wait_for_fault(uri, run_id, "is draining", driver)
    assert f"(Ray node {victims[0].node_id[:12]}) is draining (its deadline in " in told, told
    assert told.endswith(": memory checkpoints every 2 s until it goes"), told
    noticed_at = MlflowClient(uri).get_run(run_id).data.metrics["global_step"]
    time.sleep(4)  # a notice gives 30 s or more (2 minutes on AWS, 30 s on GCP and Kubernetes)
    cluster.kill_node(victims[0])
    out = finish(driver)
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == 600, out[-3000:]
    assert run.data.metrics["ps_rollbacks"] == 1, out[-3000:]
    faults = [v for k, v in sorted(run.data.tags.items()) if k.startswith("towerflow.fault.")]
    back_to = [re.search(r"rolled back to step (\d+) \(a memory checkpoint\)", v) for v in faults]
    assert any(m and int(m.group(1)) >= noticed_at for m in back_to), faults


def test_a_control_point_that_ray_starts_again_off_a_preempted_node_is_waited_for(multinode_cluster):
    """On a node drained (a preempted instance) and then lost, Ray answers calls to a run's
    control point with ActorDiedError while it starts it again on another node. Its driver (the
    control point was placed off the driver's node: a soft affinity) must not take that for the
    run's end and leave a healthy run, as it did once here; nor a resume (the control point lost
    with a preempted driver's node) for its absence, and go back to the stored checkpoint."""
    cluster = multinode_cluster
    node = cluster.add_node(num_cpus=0)
    client = subprocess.Popen(
        [sys.executable, "-c", CONTROL_POINT_CLIENT, node.node_id],
        env=cluster.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(client.stdout.readline()) == {"placed": node.node_id}
        cluster.drain_node(node, deadline_s=30)
        cluster.kill_node(node)
        client.stdin.write("lost\n")
        client.stdin.flush()
        # Past the lines Ray prints to a driver of a node's death
        heard = json.loads(next(line for line in client.stdout if line.startswith("{")))
    finally:
        client.kill()
    assert heard["stopped"] is None and heard["answered_again"] and heard["unanswered"] > 0, heard
    assert heard["resume_heard"] == {"driver_job": heard["job"]}, heard


def test_a_node_that_leaves_as_a_pod_does_drains_first_and_the_watch_sees_its_shard(multinode_cluster):
    """`towerflow cluster leave` (the Ray worker pods' preStop in k8s/) SIGTERMs the node's `ray
    start --block`, which, with RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S set, marks the node draining
    with that deadline and stops only then (an actor holds it), and waits for it: the driver's
    watch tells of the shard on it meanwhile."""
    cluster = multinode_cluster
    node = cluster.add_node(num_cpus=1, resources={"drains": 1}, drain_s=10)
    client = subprocess.Popen(
        [sys.executable, "-c", DRAIN_WATCH_CLIENT], env=cluster.env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert json.loads(client.stdout.readline()) == {"placed": node.node_id}
        leave = [sys.executable, "-m", "towerflow", "cluster", "leave", "--pid", str(node.process.pid)]
        left = subprocess.run(leave, cwd=REPO, capture_output=True, text=True, timeout=120)
        report = json.loads(client.stdout.readline())
    finally:
        client.kill()
    # It waited for the node to stop: `cluster leave` counts a zombie as ended, and a thread group
    # whose leader has exited is one while its last threads finish, before its parent can reap it.
    try:
        node.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`cluster leave` returned while the node still ran: {left.stdout + left.stderr}")
    node.killed = True
    (told,) = report["told"]
    assert (told["node"], told["shards"], report["draining"]) == (node.node_id, [0], True), report
    assert 5 <= told["in_s"] <= 10 and "is draining (its deadline in " in told["says"], report
    took_s = float(re.search(r"the Ray node stopped after ([\d.]+) s", left.stdout).group(1))
    assert left.returncode == 0 and took_s >= 8, left.stdout + left.stderr  # it drained before it stopped


def test_an_elastic_run_grows_onto_a_new_node_swaps_a_draining_ones_worker_ahead_and_shrinks(
    multinode_cluster, blob_data, tmp_path
):
    """One elastic run through every change of its size a cluster makes (one run: each costs a
    minute): it grows onto a node that joins; that node drains, and its worker, outside the run's
    placement groups, trains on until a spare, asked for at the notice and started on a node that
    joins then, takes its place in one resize, so the drained node's loss costs no worker; that
    second node is lost, its worker with it, and the run goes on without it; `towerflow scale`
    shrinks it to one worker."""
    cluster = multinode_cluster
    # 1.5 CPUs a worker: a 2-CPU node holds one, beside a shard or Ray Data's share.
    elastic = {"workers": {"min": 1, "max": 4}, "cpus_per_worker": 1.5}
    spec, uri = spec_file(tmp_path, blob_data, "elastic", cluster=elastic, max_steps=100_000)
    driver = start_driver(cluster, spec)
    run_id = wait_for_step(uri, "elastic", 10, driver)
    client = MlflowClient(uri)
    started = client.get_run(run_id).data.metrics["workers"]
    assert 1 <= started < 4
    # One more, not up to max: the spare started for the drained node's worker is then a swap.
    _scale(cluster, run_id, int(started) + 1)
    doomed = cluster.add_node(num_cpus=2)  # the one more worker starts there
    wait_for_metric(uri, run_id, "workers", started + 1, driver)
    cluster.drain_node(doomed, deadline_s=300)
    told = wait_for_fault(uri, run_id, "is draining", driver)
    assert "with worker(s) " in told and told.endswith(
        "its workers are replaced ahead, as spares start elsewhere"
    )
    spare_node = cluster.add_node(num_cpus=2)  # room for the spare asked for in its place
    deadline = time.monotonic() + 180
    while any(a["node_id"] == doomed.node_id for a in alive_actors(cluster, "TowerWorker")):
        assert time.monotonic() < deadline and driver.poll() is None, "the worker was not replaced ahead"
        time.sleep(1)
    cluster.kill_node(doomed)  # nothing of the run is left there
    assert client.get_run(run_id).data.metrics.get("workers_lost", 0) == 0
    assert any(a["node_id"] == spare_node.node_id for a in alive_actors(cluster, "TowerWorker"))
    cluster.kill_node(spare_node)  # its worker is lost; the run goes on without it
    wait_for_metric(uri, run_id, "workers", started, driver)
    _scale(cluster, run_id, 1)
    wait_for_metric(uri, run_id, "workers", 1.0, driver)
    step = client.get_run(run_id).data.metrics["global_step"]
    wait_for_step(uri, "elastic", step + 10, driver)  # and it trains on
    out = stop(driver)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED", out[-3000:]
    assert run.data.metrics["workers_lost"] == 1, out[-3000:]
    assert any(
        k.startswith("towerflow.fault.") and "went on without it" in v for k, v in run.data.tags.items()
    )
    history = [m.value for m in sorted(client.get_metric_history(run_id, "workers"), key=lambda m: m.step)]
    # the growth, the swap (one resize, the same size), the loss, the scale
    assert history == [started, started + 1, started + 1, started, 1.0], history


def _scale(cluster, run_id: str, workers: int) -> None:
    scale = [sys.executable, "-m", "towerflow", "scale", run_id, "--workers", str(workers)]
    done = subprocess.run(scale, cwd=REPO, env=cluster.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
