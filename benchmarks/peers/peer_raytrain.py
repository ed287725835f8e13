"""Peer runner: Ray Train's `TensorflowTrainer` (MultiWorkerMirroredStrategy, synchronous all-reduce).

Measures what a Ray Train user gets from the documented recipe: data read and decoded by Ray Data
(`read_tfrecords` + `map_batches`), split across the workers by Ray Train, fed to `model.fit` through
`get_dataset_shard(...).to_tf(...)`, with the model built and compiled under
`tf.distribute.MultiWorkerMirroredStrategy`. Rank 0 times the steps with a Keras callback and saves the
snapshots; the runner reads its record back after `trainer.fit()` and prints the report.

Why tf_keras: Keras 3's `fit` fails under MultiWorkerMirroredStrategy on Ray Train (it cannot convert
the strategy's PerReplica values, ray-project/ray#47464), so Ray Train + TensorFlow runs on the legacy
Keras 2 (`TF_USE_LEGACY_KERAS=1`, the `tf_keras` package). `--keras3-probe` checks that this is still so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from workloads import (
    WORKLOADS,
    Kill,
    Progress,
    RunReport,
    Snapshots,
    StepTimes,
    TrainClock,
    build,
    decode_images,
    manifest,
    report,
    runner_args,
    split_files,
)

CLOCK = TrainClock()  # process_start: startup_s counts from the runner's start, not a worker's
LEGACY = "TF_USE_LEGACY_KERAS"


def record_path(out: Path, rank: int) -> Path:
    return Path(out) / f"raytrain-rank{rank}.json"


# -- inside the Ray Train workers ------------------------------------------------------------------
# These run in Ray's worker processes: Ray puts the driver script's folder on their sys.path, so
# `workloads` imports there as it does here.
def compiled_model(strategy: Any, workload: str, keras: Any) -> Any:
    """The workload's model under the strategy, with Adam and sparse cross-entropy, in that Keras."""
    with strategy.scope():
        model = build(workload, keras)
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate=WORKLOADS[workload].learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


class Checkpoints:
    """The model's and Adam's state every `every` global batches as Ray Train checkpoints, and their
    restore when Ray Train starts the loop again after a failure (`FailureConfig`), as its guide
    has it. Every rank writes (under MultiWorkerMirroredStrategy a save may hold collectives); rank
    0's copy is the one reported, the others' go."""

    def __init__(self, model: Any, every: int, rank: int) -> None:
        import tensorflow as tf

        self.every, self.rank = every, rank
        self.state = tf.train.Checkpoint(model=model, optimizer=model.optimizer)

    def restore(self) -> int:
        """The global batches the restored checkpoint had trained (0: none to restore)."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return 0
        with checkpoint.as_directory() as folder:
            self.state.read(os.path.join(folder, "state")).expect_partial()
            return json.loads(Path(folder, "step.json").read_text())["step"]

    def report(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        import ray.train

        with tempfile.TemporaryDirectory() as folder:
            self.state.write(os.path.join(folder, "state"))
            Path(folder, "step.json").write_text(json.dumps({"step": step}))
            checkpoint = ray.train.Checkpoint.from_directory(folder) if self.rank == 0 else None
            ray.train.report({"step": step}, checkpoint=checkpoint)


def train_loop(config: dict[str, Any]) -> None:
    """Every worker: tf_keras `fit` under MultiWorkerMirroredStrategy; rank 0 times it and saves."""
    loop_start = time.time()
    import ray.train
    import tensorflow as tf
    import tf_keras

    spec = WORKLOADS[config["workload"]]
    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    model = compiled_model(strategy, config["workload"], tf_keras)
    checkpoints = Checkpoints(model, config["checkpoint_every"], rank)
    done = checkpoints.restore()  # global batches already trained: the run's restart after a failure
    progress = Progress(Path(config["out"]))
    fault = config["fault"]
    kill = Kill(fault["kill"] if rank == 1 else None, fault["kill_at"], Path(config["out"]))  # rank 1 dies

    clock = TrainClock()
    clock.process_start = config["process_start"]
    times = StepTimes(clock, config["warmup"], config["steps"], spec.global_batch)
    snaps = Snapshots(Path(config["out"]), config["snapshot_every"] if rank == 0 else 0, clock)

    class Timing(tf_keras.callbacks.Callback):
        """The contract's clock: starts with the first batch; a step ends when Keras hands back its loss."""

        first_begin_wall: float | None = None  # for the startup note

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if self.first_begin_wall is None:
                self.first_begin_wall = time.time()
            clock.start()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            step = done + batch + 1  # one epoch of the batches left: Keras's batch index counts them
            if rank == 0:
                progress.mark(step)
            if kill.due(step):
                kill.strike(os.getpid(), step)
            checkpoints.report(step)
            # tf_keras under MultiWorkerMirroredStrategy SUMs the loss metric over the workers
            # (reduce_per_replica's "auto" is "sum" there): the logs say workers x the mean loss.
            # Divided back, it is Keras's usual number, the running mean over the epoch so far.
            loss = (logs or {}).get("loss")
            times.record(step, None if loss is None else float(loss) / world)
            if snaps.due(step):
                snaps.save(step, self.model.get_weights())

    total = config["warmup"] + config["steps"]
    fit_start = time.time()
    # MultiWorkerMirroredStrategy treats each worker's dataset batch as the global batch and splits it
    # over all replicas (every worker keeps its own part: Ray's to_tf turns auto-sharding off, and Ray
    # Train already gave each worker its own shard). So batch at the global size: each worker then
    # trains on global_batch // workers examples per step, and a step covers global_batch examples.
    # repeat(): runs longer than one pass over the shard start Ray Data's next epoch.
    data = (
        ray.train.get_dataset_shard("train")
        .to_tf(feature_columns="image", label_columns="label", batch_size=spec.global_batch, drop_last=True)
        .repeat()
    )
    timing = Timing()
    # Rank 0 times; every rank reports a checkpoint (Ray Train's report is a barrier) and may be killed.
    timed = rank == 0 or checkpoints.every or kill.target
    model.fit(data, epochs=1, steps_per_epoch=total - done, verbose=0, callbacks=[timing] if timed else [])
    if rank == 0:
        record = {
            "ends": times.ends,
            "curve": times.curve,
            "first_step_wall": times.first_step_wall,
            "snapshots": snaps.taken,
            "loop_start_wall": loop_start,
            "fit_start_wall": fit_start,
            "first_begin_wall": timing.first_begin_wall,
            "per_worker_batch": spec.global_batch // world,
        }
        record_path(Path(config["out"]), rank).write_text(json.dumps(record))


def probe_loop(config: dict[str, Any]) -> None:
    """Every worker: the same fit with Keras 3; records how far it got (or the error) per rank."""
    import keras
    import ray.train
    import tensorflow as tf

    spec = WORKLOADS[config["workload"]]
    rank = ray.train.get_context().get_world_rank()
    result: dict[str, Any] = {"keras": keras.__version__, "steps": 0}
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        model = compiled_model(strategy, config["workload"], keras)
        data = (
            ray.train.get_dataset_shard("train")
            .to_tf(
                feature_columns="image", label_columns="label", batch_size=spec.global_batch, drop_last=True
            )
            .repeat()
        )
        history = model.fit(data, epochs=1, steps_per_epoch=config["steps"], verbose=0)
        result["steps"] = config["steps"]
        result["loss"] = float(history.history["loss"][-1])
    except Exception as exc:  # the probe's point: whatever fails, report it
        # The message prints the PerReplica value, batches included, over many lines: one line, without them.
        text = re.sub(r"\(PerReplica:\{.*?\}\)", "(PerReplica:{...})", " ".join(str(exc).split()))
        result["error"] = f"{type(exc).__name__}: {text[:300]}"
    record_path(Path(config["out"]), rank).write_text(json.dumps(result))


# -- the runner ------------------------------------------------------------------------------------
def train_dataset(data: Path) -> Any:
    """Ray Data: the train TFRecords, images decoded to float32 [28, 28, 1] as a tensor column."""
    import ray.data

    scale = manifest(data)["features"]["image"].get("scale", 1 / 255)

    def decode(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"image": decode_images(batch["image"], scale), "label": batch["label"].astype(np.int64)}

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray.data.read_tfrecords(split_files(data, "train")).map_batches(decode, batch_format="numpy")


def run_trainer(args: argparse.Namespace, loop: Any, steps: int) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    out = args.out.resolve()
    for old in out.glob("raytrain-rank*.json"):
        old.unlink()
    trainer = TensorflowTrainer(
        loop,
        train_loop_config={
            "workload": args.workload,
            "warmup": args.warmup,
            "steps": steps,
            "snapshot_every": args.snapshot_every,
            "checkpoint_every": args.checkpoint_every,
            "fault": {"kill": args.kill, "kill_at": args.kill_at},
            "out": str(out),
            "process_start": CLOCK.process_start,
        },
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        datasets={"train": train_dataset(args.data)},
        # Ray Train's own files (run state, no checkpoints) go under --out, never into the repo.
        run_config=RunConfig(
            name=f"raytrain-{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str(out / "raytrain"),
            # A run with a fault gets the restart Ray Train's fault-tolerance guide gives it.
            failure_config=FailureConfig(max_failures=1 if args.kill else 0),
        ),
    )
    trainer.fit()


def timed_report(args: argparse.Namespace) -> RunReport:
    run_trainer(args, train_loop, args.steps)
    record = json.loads(record_path(args.out, 0).read_text())
    times = StepTimes(CLOCK, args.warmup, args.steps, args.spec.global_batch)
    times.ends = {int(step): end for step, end in record["ends"].items()}
    times.curve = [tuple(point) for point in record["curve"]]
    times.first_step_wall = record["first_step_wall"]
    snaps = Snapshots(args.out, args.snapshot_every, CLOCK)
    snaps.taken = [tuple(taken) for taken in record["snapshots"]]
    return report(
        "raytrain",
        args,
        times,
        snaps,
        notes=[
            "Keras: tf_keras (TF_USE_LEGACY_KERAS=1); Keras 3 fails under MultiWorkerMirroredStrategy "
            "(ray-project/ray#47464)",
            f"data: Ray Data read_tfrecords + map_batches decode, to_tf batch {args.spec.global_batch} "
            f"split by the strategy into {record['per_worker_batch']} per worker per step",
            "loss: Keras's running mean over the steps so far (tf_keras sums it over workers; divided back)",
            "startup (s after the runner's start): train loop "
            + ", ".join(
                f"{name} {record[key] - CLOCK.process_start:.1f}"
                for name, key in [
                    ("starts", "loop_start_wall"),
                    ("fit starts", "fit_start_wall"),
                    ("first step begins", "first_begin_wall"),
                    ("first step done", "first_step_wall"),
                ]
            ),
        ],
    )


def probe_report(args: argparse.Namespace) -> RunReport:
    steps = 2  # enough to get past tracing into real steps; the probe stays short
    run_trainer(args, probe_loop, steps)
    records = [json.loads(path.read_text()) for path in sorted(args.out.glob("raytrain-rank*.json"))]
    errors = sorted({r["error"] for r in records if "error" in r})
    keras_version = records[0]["keras"] if records else "?"
    if errors:
        outcome = [f"Keras 3 probe (keras {keras_version}) failed: {error}" for error in errors]
    elif records and all(r["steps"] == steps for r in records):
        outcome = [
            f"Keras 3 probe (keras {keras_version}): fit under MultiWorkerMirroredStrategy WORKED "
            f"for {steps} steps (loss {records[0]['loss']:.3f}); ray-project/ray#47464 may be fixed"
        ]
    else:
        outcome = [f"Keras 3 probe: no worker record came back ({len(records)} of {args.workers})"]
    return RunReport(
        system="raytrain",
        workload=args.workload,
        workers=args.workers,
        mode=args.mode,
        global_batch=args.spec.global_batch,
        rate=0.0,
        span_s=0.0,
        steps=0,
        startup_s=0.0,
        notes=[*outcome, "Keras 3 without TF_USE_LEGACY_KERAS; nothing was timed"],
    )


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--keras3-probe", action="store_true", help="try Keras 3 instead of tf_keras")
    extra, rest = pre.parse_known_args(argv)
    args = runner_args(rest)

    # tf.keras must mean tf_keras everywhere TensorFlow is imported: here (ray.train.tensorflow imports
    # it) and in every Ray worker (the job's runtime env). The probe pins Keras 3 the same way.
    legacy = "0" if extra.keras3_probe else "1"
    os.environ[LEGACY] = legacy

    from towerflow.runtime.cluster import keep_embedded_ray_local

    keep_embedded_ray_local()  # before Ray is imported: this Ray listens on 127.0.0.1 only
    import ray

    # One CPU per train worker (Ray Train's default) plus two for Ray Data's read and decode tasks.
    ray.init(
        num_cpus=args.workers + 2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {LEGACY: legacy}},
    )
    try:
        result = probe_report(args) if extra.keras3_probe else timed_report(args)
    finally:
        ray.shutdown()
    result.emit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
