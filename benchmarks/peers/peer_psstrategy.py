"""The peers benchmark's runner for TensorFlow's `ParameterServerStrategy` + `ClusterCoordinator`.

Asynchronous training with `--ps` parameter servers (default 1) and `--workers` workers, each a
`tf.distribute.Server` in its own local process talking gRPC; this process is the coordinator (chief).
It runs the custom training loop of TensorFlow's PSStrategy tutorial: every `coordinator.schedule` is
one worker's update of `global_batch // workers` examples, applied to the PS's variables without
waiting for the others, so `workers` scheduled steps make one global batch of the run contract
(`workloads.py`).

Why tf_keras (TF_USE_LEGACY_KERAS=1): Keras 3 has no `ParameterServerStrategy` support; tf_keras is
the Keras that TensorFlow's PSStrategy path and tutorial are written against.

    python benchmarks/peers/peer_psstrategy.py --workload lenet --workers 2 --data data/bench-mnist \
        --warmup 10 --steps 40 --snapshot-every 10 --out /tmp/x
"""

from __future__ import annotations

import os

# Before TensorFlow is imported anywhere, here and (inherited) in the server processes.
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads  # noqa: E402

PART = re.compile(r"/part_\d+(?=(:\d+)?$)")  # a shard of a variable split across the PS
SERVE = "--serve"  # argv[1] of a server process: --serve CLUSTER_JSON JOB INDEX
IN_FLIGHT_PER_WORKER = 4  # scheduled, not yet fetched steps per worker: keeps every worker busy


def serve(cluster: dict[str, list[str]], job: str, index: int) -> None:
    """One task of the cluster (the PS or a worker): a gRPC server that runs what the chief sends."""
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc", start=True
    )
    server.join()


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (all held open at once, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_servers(cluster: dict[str, list[str]], out: Path) -> list[subprocess.Popen]:
    """The PS and the workers as local processes; their (chatty) output goes to files under `out`."""
    env = dict(os.environ)
    # On a GPU machine the workers share it: let none of them take all its memory up front.
    env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    procs = []
    for job in ("ps", "worker"):
        for index in range(len(cluster[job])):
            task_env = dict(env, CUDA_VISIBLE_DEVICES="") if job == "ps" else env  # the PS updates on its CPU
            with open(out / f"server-{job}-{index}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, SERVE, json.dumps(cluster), job, str(index)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=task_env,
                    )
                )
    return procs


def wait_for_servers(procs: list[subprocess.Popen], addresses: list[str], timeout: float = 300) -> None:
    """Until every server accepts connections: a server still importing TensorFlow would otherwise
    cost the chief its connection retries, and one that died should fail the run with its log."""
    deadline = time.monotonic() + timeout
    for proc, address in zip(procs, addresses):
        host, port = address.rsplit(":", 1)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server at {address} exited with {proc.returncode}; see its log")
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no server at {address} after {timeout:.0f}s") from None
                time.sleep(0.2)


def stop_servers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait(timeout=30)


def whole_weights(variables: list[Any]) -> list[np.ndarray]:
    """The model's weights as the contract's list: tf_keras lists a variable split across PS as its
    parts (`<name>/part_<i>`, split along axis 0), which are put back together here."""
    weights: list[np.ndarray] = []
    last = None
    for v in variables:
        name = PART.sub("", v.name)
        if PART.search(v.name) and name == last:
            weights[-1] = np.concatenate([weights[-1], v.numpy()], axis=0)
        else:
            weights.append(v.numpy())
        last = name
    return weights


def train(
    args: argparse.Namespace,
    cluster: dict[str, list[str]],
    clock: workloads.TrainClock,
    procs: list[subprocess.Popen],
) -> workloads.RunReport:
    import tensorflow as tf
    import tf_keras

    spec, workers = args.spec, args.workers
    per_worker_batch = spec.global_batch // workers
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    # Creating the strategy connects this process to the servers. With several PS, large variables are split across them as the PSStrategy tutorial does (without
    # a partitioner each variable would sit whole on one PS, round-robin).
    partitioner = None
    if args.ps > 1:
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=args.ps
        )
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    with strategy.scope():  # the variables (weights and Adam's slots) live on the PS(s)
        model = workloads.build(args.workload, tf_keras)
        optimizer = tf_keras.optimizers.Adam(learning_rate=spec.learning_rate)
        loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf_keras.losses.Reduction.NONE
        )

    train_examples = workloads.manifest(args.data)["splits"]["train"]["examples"]

    def dataset_fn() -> tf.data.Dataset:
        # Every worker runs this same function (PSStrategy gives no worker index), so without the
        # unseeded random offset all of them would read the same batches in the same order.
        ds = workloads.tf_dataset(args.data, "train", per_worker_batch)
        offset = tf.random.uniform([], 0, train_examples // per_worker_batch, dtype=tf.int64)
        return ds.skip(offset)

    @tf.function
    def step_fn(iterator: Any) -> tf.Tensor:
        def replica_fn(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                # One worker's update is a whole step on its own batch: the mean over that batch.
                loss = tf.reduce_mean(loss_fn(labels, model(images, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        images, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(images, labels))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

    # The tutorial's checkpoints (--checkpoint-every): what a run restarted after a lost PS resumes from.
    manager, done = None, 0
    if args.checkpoint_every:
        state = tf.train.Checkpoint(model=model, optimizer=optimizer)
        manager = tf.train.CheckpointManager(state, str(args.out / "checkpoints"), max_to_keep=2)
        if manager.latest_checkpoint:
            state.restore(manager.latest_checkpoint)
            done = int(manager.latest_checkpoint.rsplit("-", 1)[1])

    per_worker_iter = iter(coordinator.create_per_worker_dataset(dataset_fn))
    times = workloads.StepTimes(clock, args.warmup, args.steps, spec.global_batch)
    snaps = workloads.Snapshots(args.out, args.snapshot_every, clock)
    total = (args.warmup + args.steps) * workers  # scheduled steps: the same examples as sync's steps
    progress, kill = workloads.Progress(args.out), workloads.Kill(args.kill, args.kill_at, args.out)
    victim = procs[0] if args.kill == "ps" else procs[args.ps + 1] if args.kill == "worker" else None
    pending: deque[Any] = deque()
    scheduled = completed = done * workers
    losses: list[float] = []

    saving = False  # a checkpoint is due: the steps in flight end first (the tutorial joins, then saves)
    clock.start()
    while completed < total:
        if saving and not pending:
            manager.save(checkpoint_number=completed // workers)
            saving = False
        while not saving and scheduled < total and len(pending) < IN_FLIGHT_PER_WORKER * workers:
            pending.append(coordinator.schedule(step_fn, args=(per_worker_iter,)))
            scheduled += 1
        # No join here (it would drain every worker): fetching the oldest step in order waits only
        # for it, so a global batch counts as done once its `workers`-th update is in.
        losses.append(float(pending.popleft().fetch()))
        completed += 1
        if completed % workers:
            continue
        step = completed // workers
        times.record(step, sum(losses) / len(losses))
        losses.clear()
        progress.mark(step)
        if victim is not None and kill.due(step):
            kill.strike(victim.pid, step)
        saving = saving or bool(manager and step % args.checkpoint_every == 0)
        if snaps.due(step):
            # Read straight from the PS while the workers train on through the steps in flight (so
            # the clock runs on): the snapshot may hold some of their updates, and is no atomic cut
            # across variables.
            at = clock.now()
            snaps.save(step, whole_weights(model.weights), at=at)
    coordinator.join()

    return workloads.report(
        "psstrategy",
        args,
        times,
        snaps,
        notes=[
            f"tf_keras, TF_USE_LEGACY_KERAS=1; {args.ps} PS, {workers} workers, local processes, gRPC",
            f"async: one scheduled step = one worker's update of {per_worker_batch} examples; "
            f"{workers} steps = one global batch; up to {IN_FLIGHT_PER_WORKER * workers} in flight",
            "each worker reads the train split from its own random offset",
            "snapshots are read from the PS while the workers keep training (the clock runs on)",
        ],
    )


def main(argv: list[str] | None = None) -> None:
    clock = workloads.TrainClock()  # the process start, for startup_s
    args = workloads.runner_args(argv, modes=("async",))
    chief, *ports = free_ports(1 + args.ps + args.workers)
    cluster = {
        "chief": [f"127.0.0.1:{chief}"],
        "ps": [f"127.0.0.1:{port}" for port in ports[: args.ps]],
        "worker": [f"127.0.0.1:{port}" for port in ports[args.ps :]],
    }
    procs = start_servers(cluster, args.out)
    try:
        wait_for_servers(procs, cluster["ps"] + cluster["worker"])
        train(args, cluster, clock, procs).emit()
    finally:
        stop_servers(procs)
    # With the servers gone, TensorFlow's exit-time cleanup only logs failed RPCs to them (and could
    # wait on them): the result is out, so skip it.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == SERVE:
        serve(json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        main()
