"""towerflow sync or async, through `towerflow.launch.train` on a local Ray of its own.

The spec is pipelines/mnist_sync.yaml (sync) or mnist_async.yaml (async) with the workload's model
and batch, no evaluation, checkpoint or export, and no tracking: what is timed is training. Step
times are the driver's (`StepEvent.elapsed_s`); a snapshot is the shards' state at that very step
(`capture_state(version)`), taken while training goes on, so nothing is paused.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import statistics  # noqa: E402
import time  # noqa: E402

from cpu_roles import cpu_by_process, used_between  # noqa: E402
from workloads import (  # noqa: E402
    ROOT,
    Kill,
    Progress,
    Snapshots,
    StepTimes,
    TrainClock,
    report,
    runner_args,
)

from towerflow.runtime.hooks import Hook  # noqa: E402


class Recorder(Hook):
    """Global batches done (examples seen / global batch) and their time; snapshots at set steps;
    the run contract's fault (worker 1's or shard 0's process SIGKILLed)."""

    def __init__(
        self, times: StepTimes, snaps: Snapshots, updates_per_batch: int, progress: Progress, kill: Kill
    ) -> None:
        self.times, self.snaps, self.updates_per_batch = times, snaps, updates_per_batch
        self.progress, self.kill = progress, kill
        self.splits: list[dict[str, float]] = []
        self.cpu: list[tuple[float, dict]] = []  # (wall, CPU by process) at the window's ends

    def begin(self, session) -> None:
        if self.snaps.every:
            session.snapshot_every = self.snaps.every * self.updates_per_batch

    def after_run(self, context, event) -> None:
        batches = event.examples_seen // self.times.global_batch
        self.times.record(batches, event.loss, at=event.elapsed_s)
        self.progress.mark(batches)
        if batches >= self.times.warmup + self.times.steps:
            # The contract counts examples: a sync step taken while a worker is lost holds fewer.
            context.request_stop("the run's examples are done")
        if self.kill.due(batches):
            import ray

            runtime = context.session.runtime
            actor = runtime.group.slots[1].actor if self.kill.target == "worker" else runtime.shards[0]
            self.kill.strike(ray.get(actor.pid.remote()), batches)
        if self.times.warmup < batches <= self.times.warmup + self.times.steps:
            self.splits.append(dict(event.time_split))
        ends = (self.times.warmup, self.times.warmup + self.times.steps)
        if len(self.cpu) < 2 and batches >= ends[len(self.cpu)]:
            self.cpu.append((time.perf_counter(), cpu_by_process()))
        every = self.snaps.every * self.updates_per_batch
        if every and event.global_step % every == 0:
            state = context.session.runtime.capture_state(event.global_step)
            self.snaps.save(batches, [state.variables[n] for n in state.names], at=event.elapsed_s)


def main() -> None:
    args = runner_args(modes=("sync", "async"))
    clock = TrainClock()
    from towerflow.runtime.cluster import keep_embedded_ray_local

    keep_embedded_ray_local()  # before Ray's import: it reads the switches then
    import ray

    from towerflow.launch import train
    from towerflow.spec import load_spec

    spec, workers = args.spec, args.workers
    updates_per_batch = workers if args.mode == "async" else 1  # an async update is one worker's batch
    overrides = [
        f"name=bench-{args.workload}-{args.mode}-{workers}w",
        f"model.ref={spec.model_ref}",
        f"data.train.paths={args.data}/train-*",
        "data.eval=null",
        "data.epochs=null",
        f"data.batch_size={spec.global_batch // workers}",
        f"cluster.workers={workers}",
        f"cluster.ps={args.ps}",
        "cluster.cpus_per_worker=1",
        "cluster.cpus_per_ps=0.5",
        "cluster.data_cpus=1",
        # (a fault's run may need more steps for its examples: a guard, not the end)
        f"training.max_steps={(args.warmup + args.steps) * updates_per_batch * (2 if args.kill else 1)}",
        f"training.optimizer.learning_rate={spec.learning_rate}",
        "export.saved_model=false",
        "export.register_as=null",
        "supervision.eval=null",
    ]
    if args.checkpoint_every:  # where the shards roll back to when one is lost
        every = args.checkpoint_every * updates_per_batch
        overrides += ["supervision.checkpoint.enabled=true", f"supervision.checkpoint.every_steps={every}"]
    else:
        overrides.append("supervision.checkpoint.enabled=false")
    if args.mode == "async":
        overrides.append(f"training.fetch_every={args.fetch_every}")
        overrides.append(f"training.overlap_push={str(args.overlap_push).lower()}")
    if args.mode == "sync":
        overrides += [f"training.replicas_to_aggregate={workers}", f"training.total_num_replicas={workers}"]
    base = ROOT / "pipelines" / f"mnist_{args.mode}.yaml"
    job = load_spec(base, overrides)
    times = StepTimes(clock, args.warmup, args.steps, spec.global_batch)
    snaps = Snapshots(args.out, args.snapshot_every, clock)
    recorder = Recorder(
        times, snaps, updates_per_batch, Progress(args.out), Kill(args.kill, args.kill_at, args.out)
    )
    os.chdir(ROOT)  # model refs (models., benchmarks.) import from the repository root
    ray.init(num_cpus=workers + 2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        result = train(job, hooks=[recorder], track=False, output_dir=args.out / "run")
    finally:
        ray.shutdown()
    split = {p: statistics.median(s[p] for s in recorder.splits) for p in recorder.splits[0]}
    notes = [f"{args.ps} PS shard(s); async max_staleness {job.training.max_staleness}"]
    lead = result.shards[0]
    if "publications" in lead:  # async updates applied back to back share a publication
        notes.append(f"shard 0 published {lead['publications']} versions of {lead['applied']}")
    extra = {}
    if len(recorder.cpu) == 2:  # CPU seconds per global batch by process role, and Ray's share
        (began, before), (ended, after) = recorder.cpu
        used = used_between(before, after)
        extra["cpu_per_batch"] = {role: seconds / args.steps for role, seconds in used.items()}
        extra["other_cores"] = used["other"] / (ended - began)
    report(f"towerflow_{args.mode}", args, times, snaps, split=split, notes=notes, **extra).emit()


if __name__ == "__main__":
    main()
