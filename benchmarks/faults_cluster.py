"""The faults of benchmarks/faults.py that need several nodes or a driver of their own.

The cluster is tests/multinode.py's LocalCluster: a head and two extra nodes, 2 CPUs each, every
node its own `ray start --block` (token authentication on), all on this machine. Every run's driver
is `python -m towerflow train SPEC --no-progress` as a user starts it (RAY_ADDRESS: the cluster),
tracked to a SQLite MLflow store of its own; this process only starts and kills nodes and drivers,
and reads MLflow and Ray's state API. The workload is faults.py's: LeNet on synthetic MNIST,
128 examples a worker, one shard, a checkpoint every `--every` steps, metrics to MLflow every step;
sized for 2-CPU nodes (1 CPU a worker, 0.5 a shard, 0.5 for Ray Data).

Each faulted run is paired with a clean run of the same configuration in the same round:
- node lost (sync): 2 workers; once MLflow shows step `--at`, the node holding a worker (not the
  shard's, not the head) is lost, its raylet and every process of it SIGKILLed; then a fresh 2-CPU
  node joins, so that the next case has the same room. Recovery: MLflow's `worker_recovery_s` (the
  loss noticed to the replacement's first step).
- driver killed (sync): the driver, started with `--resume auto`, is SIGKILLed (its process group)
  at step `--at` (or at the run's first checkpoint, if that comes later: without one `--resume auto`
  starts a new run), and `--resume auto` started again: it takes the live shards and workers over (runtime/
  run_keeper.py). Steps redone: the step MLflow had heard of at the kill (the driver may have been
  a step or two further) less `towerflow.resumed_from_step`, 0 where it resumed past it;
  seconds lost: both drivers' wall time less the clean run's; recovery: the second driver's start
  to its first step in MLflow. Row "shards not kept": the same with `driver_grace_s: null` (the
  shards end with the driver; the new one goes on from the stored checkpoint, as before the
  takeover). Row "started again by its command": the command's child, the driver alone, SIGKILLed
  at the same point with `training.failure.driver_restarts: 1`; the command starts it again and it
  takes the shards and workers over. Seconds lost: the command's wall time less the clean run's;
  recovery: the kill to the first step in MLflow after it.
- shard's node lost (sync): 2 workers, one shard kept off the head as the run places; `--drain-s`
  seconds after step `--at` the shard's node is lost; row "after a drain notice": at step `--at`
  Ray is told the node goes (`ray drain-node`, reason preemption, as the autoscaler tells of a
  preempted instance), and the run keeps memory checkpoints every 2 s until it goes
  (`training.failure.memory_checkpoint_draining_s`); row "no notice": no drain, memory checkpoints
  every 30 s (the default). No stored checkpoint within the run in either. Against a clean run of
  the same `3 * --steps` steps ("clean sync, longer").
- elastic: one run of `workers: {min: 1, max: 4}` over `--elastic-steps` steps (1.5 CPUs a worker:
  a 2-CPU node holds one, so the three nodes hold three and a fourth waits as a pending spare). At
  step `--at` a 2-CPU node joins; row "elastic: node joins": survived when the run grew (MLflow's
  `workers` metric up) and trained on; recovery: the node alive to the `workers` record. Then that
  node is lost; row "elastic: node lost": survived when the run shrank (`workers` down), trained on
  and finished at max_steps; recovery: the kill to the `workers` record. Seconds are MLflow's own
  record timestamps against this machine's clock; the notes add the pause from each resize to the
  next step (the data pipeline starts again).
- elastic: node drained, then lost: the same run, but the node the run grew onto is drained once
  it holds a worker (`ray drain-node`) and another 2-CPU node joins: the spare asked for at the
  notice starts there and takes the worker's place in one resize; then the drained node is lost.
  Survived: no worker lost and the run finished at max_steps; recovery: the notice to that resize.
- head lost and started again (sync), GCS in Redis: on a cluster of its own (its GCS's tables in a
  real Redis, tests/redis_store.py; a head with no CPUs and two 2-CPU nodes), `3 * --steps` steps,
  the driver on a node that is not the head's (as in k8s/overlays/cpu-ha); at step `--at` the head
  is SIGKILLed and started again 3 s later on the same ports. Against a clean run of the same
  configuration on that cluster. Recovery: the head's kill to alive again; the notes add the steps
  MLflow heard of meanwhile (the run trains on through it: runtime/head_watch.py).
- driver killed with the head it ran on (sync): that cluster, the driver on the head (where `ray
  job submit` puts it), `driver killed`'s kill point and measures; the head started again as above
  before the second `--resume auto` (a RayJob's retry), which takes the live shards over from the
  run's control point (started again by Ray where it was on the head: runtime/run_control.py).
- head lost with a worker's node (sync): as "head lost", but a node holding a worker (not the
  shard's) is SIGKILLed with the head, as one Kubernetes node with both pods; the driver on a
  0-CPU node of its own, and a 2-CPU node joins before the run (the replacement's room).
  Survived: also the lost worker replaced; the notes add the longest gap between steps heard of.

Survived, in the other rows: the driver exits 0 and its MLflow run is FINISHED at max_steps. One round is
twelve drivers' runs and two resumed ones: about 32 minutes on 2 cores with the cluster's start
(estimated from its parts: the shard's-node rows took 8 minutes for two rounds, the elastic ones
13), up to 5 more where a resize never comes (RESIZE_TIMEOUT_S); the head's-loss pair, on its own
cluster, 3 more a round (10 minutes for three rounds with that cluster's start); `--only` runs a part.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from faults_cluster_elastic import ELASTIC_DRAINED, clean_elastic, elastic, elastic_drained
from faults_cluster_rows import SYNC, Log, clean_run, result, write_spec
from faults_driver import (
    CaseError,
    Driver,
    actors,
    mlflow_client,
    now_ms,
    poll_store,
    run_outcome,
    seconds_after,
    start_driver,
    victim_node,
    wait_for_checkpoint,
    wait_for_record,
    wait_for_step,
)

DRIVER_KILLED = "driver killed (sync)"
DRIVER_KILLED_NOT_KEPT = "driver killed (sync), shards not kept"  # driver_grace_s: null, as before
DRIVER_RESTARTED = "driver killed (sync), started again by its command"  # training.failure.driver_restarts
SHARD_NODE_LOST = "shard's node lost (sync), no notice"
SHARD_NODE_DRAINED = "shard's node lost (sync), after a drain notice"  # memory_checkpoint_draining_s
CLEAN_LONGER = "clean sync, longer"
HEAD_LOST = "head lost and started again (sync), GCS in Redis"
CLEAN_FT = "clean sync, GCS in Redis"
DRIVER_WITH_HEAD = "driver killed with the head it ran on (sync), GCS in Redis"
HEAD_WITH_NODE = "head lost with a worker's node (sync), GCS in Redis"
# The rows run on a cluster of their own: its GCS's tables in a Redis, a head with no CPUs.
GCS_FT_ROWS = frozenset({HEAD_LOST, CLEAN_FT, DRIVER_WITH_HEAD, HEAD_WITH_NODE})
# Which rows each kind of run gives, and each faulted row's clean run.
BASELINE = {
    "node lost (sync)": "clean sync",
    DRIVER_KILLED: "clean sync",
    DRIVER_KILLED_NOT_KEPT: "clean sync",
    DRIVER_RESTARTED: "clean sync",
    SHARD_NODE_LOST: CLEAN_LONGER,
    SHARD_NODE_DRAINED: CLEAN_LONGER,
    "elastic: node joins": "clean elastic",
    "elastic: node lost": "clean elastic",
    ELASTIC_DRAINED: "clean elastic",
    HEAD_LOST: CLEAN_FT,
    DRIVER_WITH_HEAD: CLEAN_FT,
    HEAD_WITH_NODE: CLEAN_FT,
}


# -- the runs ---------------------------------------------------------------------------------------


def clean_sync(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    return {"clean sync": clean_run(cluster, args, tmp, "clean-sync", SYNC, args.steps)}


def longer_steps(args) -> int:
    """max_steps of the shard's-node rows: room for the notice's seconds after step `--at`."""
    return 3 * args.steps


def clean_longer(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    return {CLEAN_LONGER: clean_run(cluster, args, tmp, "clean-longer", SYNC, longer_steps(args))}


def shard_node_lost(cluster, args, tmp: Path, log: Log, *, notice: bool) -> dict[str, dict]:
    """The lone shard's node (kept off the head while the run places) is lost `--drain-s` seconds
    after step `--at`; with `notice`, Ray is told at step `--at` that the node goes (`ray
    drain-node`, as the autoscaler tells of a preempted instance). No stored checkpoint within the
    run (as a checkpoint every 10 minutes would be): the rollback goes to the newest memory
    checkpoint (a worker on another node holds the shard's copy), or the run's start."""
    from multinode_drivers import node_held  # tests/ (run_cluster_cases puts it on the path)

    job = "shard-drained" if notice else "shard-lost"
    client = mlflow_client(tmp)
    spec = write_spec(tmp, job, args, SYNC, longer_steps(args), "supervision.checkpoint.every_steps=100000")
    driver = victim = None
    try:
        with node_held(cluster, cluster.head):  # until the run has placed its actors
            driver = start_driver(cluster, spec, tmp / "driver.log")
            run_id, seen = wait_for_step(client, job, args.at, driver)
        (shard,) = actors(cluster, "ParameterShard")
        victim = next(n for n in cluster.nodes if not n.killed and n.node_id == shard["node_id"])
        if notice:
            cluster.drain_node(victim, deadline_s=int(args.drain_s) + 30)
        time.sleep(args.drain_s)
        cluster.kill_node(victim)
        log(f"  {victim.name} (the shard's) lost {args.drain_s:g} s after step {seen:g}, notice: {notice}")
        driver.wait()
    finally:
        if driver is not None:
            driver.kill()
        if victim is not None:
            cluster.add_node(num_cpus=2)  # the room the next case expects
    ok, run, notes = run_outcome(client, run_id, driver, longer_steps(args))
    return {
        SHARD_NODE_DRAINED if notice else SHARD_NODE_LOST: result(
            driver.wall_s,
            ok,
            examples_per_sec=driver.examples_per_sec(),
            steps_redone=run.data.metrics.get("steps_redone", 0.0),
            notes=notes,
        )
    }


def clean_gcs_ft(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    return {
        CLEAN_FT: clean_run(
            cluster,
            args,
            tmp,
            "clean-ft",
            SYNC,
            longer_steps(args),
            *OFF_THE_HEAD,
            node=off_the_head(cluster),
        )
    }


# The driver on another node than the head (as a RayJob's in the drivers group of k8s/overlays/
# cpu-ha), its command running it alone (a restarted one would join the head: train_command).
OFF_THE_HEAD = ("training.failure.driver_restarts=0",)


def off_the_head(cluster) -> Any:
    """A live node with CPUs that is not the head: where those drivers run (a node lost by an
    earlier case is not there any more)."""
    return next(n for n in cluster.nodes[1:] if not n.killed and n.num_cpus > 0)


def head_lost(cluster, args, tmp: Path, log: Log, *, with_node: bool = False) -> dict[str, dict]:
    """The head SIGKILLed at step `--at` (its GCS, raylet and dashboard) and started again 3 s later on
    the same ports, as KubeRay restarts a lost head pod; the GCS reads its tables back from Redis.
    The driver and every actor of the run are on the other nodes. Recovery: the head's restart (its
    kill to alive again); the notes add the steps MLflow heard of while it was away. `with_node`: a
    node with a worker (not the shard's) is lost with the head, as one Kubernetes node with both
    pods; the driver is then on a node of its own with no CPUs, and a 2-CPU node joins first (room
    for the replacement, and the next case's room once the lost one is gone)."""
    row, name = (HEAD_WITH_NODE, "head-node-lost") if with_node else (HEAD_LOST, "head-lost")
    client = mlflow_client(tmp)
    steps = longer_steps(args)  # room for the head's absence within the run
    node = off_the_head(cluster)
    if with_node:
        node = next((n for n in cluster.nodes[1:] if not n.killed and n.num_cpus == 0), None)
        node = node or cluster.add_node(num_cpus=0)  # kept for the next rounds
        cluster.add_node(num_cpus=2)
    spec = write_spec(tmp, name, args, SYNC, steps, *OFF_THE_HEAD)
    driver = start_driver(cluster, spec, tmp / "driver.log", node=node)
    try:
        run_id, seen = wait_for_step(client, name, args.at, driver)
        victim = victim_node(cluster) if with_node else None
        if with_node and victim is None:
            raise CaseError("no node with a worker apart from the shard's")
        lost, started = now_ms(), time.monotonic()
        if victim is not None:
            cluster.kill_node(victim)
        cluster.restart_head()
        away_s, back = time.monotonic() - started, now_ms()
        log(f"  head lost at step {seen:g} (MLflow), alive again {away_s:.1f} s later")
        driver.wait()
    finally:
        driver.kill()
    ok, run, notes = run_outcome(client, run_id, driver, steps)
    history = sorted(client.get_metric_history(run_id, "global_step"), key=lambda m: m.timestamp)
    during = [m.value for m in history if lost < m.timestamp < back]
    notes.append(
        f"steps heard of while the head was away: {len(during)}"
        + (f" ({min(during):g} to {max(during):g})" if during else "")
        + f"; the longest time between two: {max_gap_s(history):.1f} s"
    )
    if with_node:
        ok = ok and run.data.metrics.get("workers_replaced") == 1
    return {
        row: result(
            driver.wall_s, ok, examples_per_sec=driver.examples_per_sec(), recovery_s=away_s, notes=notes
        )
    }


def max_gap_s(history: list[Any]) -> float:
    """The longest time between two records of a metric's history (sorted by time), in seconds."""
    return max((b.timestamp - a.timestamp for a, b in zip(history, history[1:])), default=0) / 1000


def node_lost(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    name = "node lost (sync)"
    client = mlflow_client(tmp)
    driver = start_driver(cluster, write_spec(tmp, "node-lost", args, SYNC, args.steps), tmp / "driver.log")
    victim = None
    try:
        run_id, seen = wait_for_step(client, "node-lost", args.at, driver)
        victim = victim_node(cluster)
        if victim is None:
            placed = [(a["node_id"][:8], a["class_name"]) for a in actors(cluster, "TowerWorker")]
            return {name: result(driver.wall_s, None, notes=[f"no worker apart from the shard: {placed}"])}
        cluster.kill_node(victim)
        log(f"  {victim.name} lost at step {seen:g} (MLflow)")
        driver.wait()
    finally:
        driver.kill()
        if victim is not None:
            cluster.add_node(num_cpus=2)  # the room the next case expects
    ok, run, notes = run_outcome(client, run_id, driver, args.steps)
    return {
        name: result(
            driver.wall_s,
            ok,
            examples_per_sec=driver.examples_per_sec(),
            steps_redone=run.data.metrics.get("steps_redone", 0.0),
            recovery_s=run.data.metrics.get("worker_recovery_s"),
            notes=notes,
        )
    }


def at_the_kill_point(client, name: str, args, driver: Driver) -> tuple[str, float, int]:
    """Once run `name` is at step `--at` and has its first checkpoint (with --at below --every: a
    resume needs one to go on from, where the shards are not kept): its id, the step MLflow has
    heard of, and the checkpoint's step."""
    run_id, heard = wait_for_step(client, name, args.at, driver)
    checkpoint = wait_for_checkpoint(client, run_id, driver)
    heard = max(heard, poll_store(lambda: client.get_run(run_id).data.metrics["global_step"]) or 0)
    return run_id, heard, checkpoint


def resumed_outcome(
    client, run_id: str, driver: Driver, steps: int, heard: float, says: str
) -> tuple[bool, float | None, list[str]]:
    """A resumed run's outcome: survived (FINISHED at `steps`, the one run of its experiment, resumed),
    the steps redone (`heard`, the step MLflow had at the kill, less the step resumed from), and notes
    with the driver's lines that hold `says` or took the live shards over."""
    ok, run, notes = run_outcome(client, run_id, driver, steps)
    resumed = run.data.tags.get("towerflow.resumed_from_step")
    runs = client.search_runs([run.info.experiment_id])
    if len(runs) != 1 or resumed is None:
        ok = False
        notes.append(f"{len(runs)} run(s) in the experiment, resumed_from_step {resumed}")
    notes += [line for line in driver.text().splitlines() if says in line or "took over run" in line]
    return ok, max(0, heard - int(resumed)) if resumed is not None else None, notes


def driver_killed(
    cluster, args, tmp: Path, log: Log, *, kept: bool = True, with_head: bool = False
) -> dict[str, dict]:
    """`kept`: the shards outlive the driver and the new one takes them over (the default), else
    they end with it (`driver_grace_s: null`) and the new one goes on from the stored checkpoint.
    `with_head`: the head lost with the driver on it (and the run's control point beside it)."""
    client = mlflow_client(tmp)
    extra = () if kept else ("training.failure.driver_grace_s=null",)
    steps = longer_steps(args) if with_head else args.steps  # as its clean run's
    spec = write_spec(tmp, "driver-lost", args, SYNC, steps, *extra)
    first = start_driver(cluster, spec, tmp / "driver.log", "--resume", "auto")
    try:
        run_id, heard, checkpoint = at_the_kill_point(client, "driver-lost", args, first)
    finally:
        first.kill()  # as a lost head pod loses it: nobody closes the MLflow run
    if with_head:
        log(f"  head alive again {cluster.restart_head():.1f} s after its start")
    log(f"  driver killed at step {heard:g} (MLflow), its newest checkpoint at step {checkpoint}")
    restarted = now_ms()
    second = start_driver(cluster, spec, tmp / "driver2.log", "--resume", "auto")
    try:
        recovery = seconds_after(wait_for_record(client, run_id, "global_step", restarted, second), restarted)
        second.wait()
    finally:
        second.kill()
    ok, redone, notes = resumed_outcome(client, run_id, second, steps, heard, "--resume auto")
    row = DRIVER_WITH_HEAD if with_head else DRIVER_KILLED if kept else DRIVER_KILLED_NOT_KEPT
    return {
        row: result(first.wall_s + second.wall_s, ok, steps_redone=redone, recovery_s=recovery, notes=notes)
    }


def driver_restarted(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    """The command's child (its driver) SIGKILLed at the point `driver_killed` kills the whole
    driver; the command starts it again (`training.failure.driver_restarts`), and it takes the
    live shards and workers over."""
    import psutil

    client = mlflow_client(tmp)
    spec = write_spec(tmp, "driver-restarted", args, SYNC, args.steps, "training.failure.driver_restarts=1")
    command = start_driver(cluster, spec, tmp / "driver.log")
    try:
        run_id, heard, _ = at_the_kill_point(client, "driver-restarted", args, command)
        (driver,) = psutil.Process(command.process.pid).children()
        killed = now_ms()
        driver.kill()  # the driver alone, as the OOM killer picks it
        log(f"  driver (pid {driver.pid}) killed at step {heard:g} (MLflow)")
        recovery = seconds_after(wait_for_record(client, run_id, "global_step", killed, command), killed)
        command.wait()
    finally:
        command.kill()
    ok, redone, notes = resumed_outcome(client, run_id, command, args.steps, heard, "starting it again")
    return {
        DRIVER_RESTARTED: result(command.wall_s, ok, steps_redone=redone, recovery_s=recovery, notes=notes)
    }


# What each run gives: its function and the rows it fills.
RUNS: list[tuple[Callable[..., dict[str, dict]], tuple[str, ...]]] = [
    (clean_sync, ("clean sync",)),
    (node_lost, ("node lost (sync)",)),
    (driver_killed, (DRIVER_KILLED,)),
    (functools.partial(driver_killed, kept=False), (DRIVER_KILLED_NOT_KEPT,)),
    (driver_restarted, (DRIVER_RESTARTED,)),
    (clean_longer, (CLEAN_LONGER,)),
    (functools.partial(shard_node_lost, notice=False), (SHARD_NODE_LOST,)),
    (functools.partial(shard_node_lost, notice=True), (SHARD_NODE_DRAINED,)),
    (clean_elastic, ("clean elastic",)),
    (elastic, ("elastic: node joins", "elastic: node lost")),
    (elastic_drained, (ELASTIC_DRAINED,)),
    (clean_gcs_ft, (CLEAN_FT,)),
    (head_lost, (HEAD_LOST,)),
    (functools.partial(driver_killed, with_head=True), (DRIVER_WITH_HEAD,)),
    (functools.partial(head_lost, with_node=True), (HEAD_WITH_NODE,)),
]
