"""What only a GPU shows, in one command, for docs/gpu.md.

On a machine with NVIDIA GPUs: NVML's readings; a short tracked LeNet job with one worker per GPU
(memory growth on) and the per-GPU system metrics MLflow recorded for it; `towerflow gpus`; a
second job under `tf_config.memory_limit_mb` and the peak memory TensorFlow reached under it; and
untracked jobs with and without gradient buckets pushed during backprop (`cluster.push_bucket_bytes`),
interleaved, to see whether the overlap pays once the backward pass runs on a GPU (it does not on
2 CPU cores: docs/benchmarks.md).

    python benchmarks/gpu_check.py                 # on the GPU machine
    python benchmarks/gpu_check.py --cpu-smoke     # the same path on CPUs (no GPU checks)

The last line is `gpu_check=ok` or `gpu_check=failed (<what>)`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import ensure_mnist, machine, make_log

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "pipelines" / "mnist_sync.yaml"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
log = make_log("gpu_check")


def job(args: argparse.Namespace, workdir: Path, gpus: int, name: str, extra: list[str]):
    from towerflow.spec import load_spec

    workers = max(1, gpus)
    overrides = [
        f"name={name}",
        f"data.train.paths={workdir}/mnist/train-*",
        "data.eval=null",
        "data.epochs=null",
        "data.batch_size=256",
        f"cluster.workers={workers}",
        "cluster.ps=2",
        f"cluster.gpus_per_worker={1 if gpus else 0}",
        "cluster.towers=1",
        f"training.replicas_to_aggregate={workers}",
        f"training.total_num_replicas={workers}",
        f"training.max_steps={args.steps}",
        f"tracking.tracking_uri=sqlite:///{workdir}/mlflow.db",
        "tracking.experiment=gpu-check",
        "tracking.system_metrics_interval_s=1",
        "export.saved_model=false",
        "export.register_as=null",
        "supervision.eval=null",
        "supervision.checkpoint.enabled=false",
        *extra,
    ]
    return load_spec(SPEC, overrides)


def compare_buckets(args: argparse.Namespace, workdir: Path, gpus: int) -> None:
    """Examples/sec with one push a step against 4 MiB buckets pushed during backprop (informative)."""
    from towerflow.launch import train

    settings = {
        "one push a step": "cluster.push_bucket_bytes=null",
        "4 MiB buckets": "cluster.push_bucket_bytes=4194304",
    }
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(args.bucket_rounds):
        for name, setting in settings.items():
            log(f"bucket comparison round {r + 1}/{args.bucket_rounds}: {name}")
            result = train(job(args, workdir, gpus, "gpu-check-buckets", [setting]), track=False)
            rates[name].append(result.examples_per_sec)
    print("\npushing during backprop (untracked runs, examples/sec per round):")
    for name, values in rates.items():
        print(f"  {name:<16} {', '.join(f'{v:,.0f}' for v in values)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--memory-limit-mb", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the path on CPUs; skip GPU checks")
    parser.add_argument("--bucket-rounds", type=int, default=2, help="rounds of the bucket comparison")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    failures: list[str] = []
    print(f"# towerflow GPU check, {time.strftime('%Y-%m-%d %H:%M')}\nmachine: {machine()}")

    from towerflow.tf_import import import_tensorflow
    from towerflow.tracking.gpu import read_gpus

    import_tensorflow(gpus=False)  # as towerflow's driver does (the data generation imports it first)
    readings = read_gpus()
    print(f"\nNVML: {len(readings)} GPU(s)")
    for r in readings:
        fields = ", ".join(f"{k}={v:g}" for k, v in sorted(r.fields.items()))
        print(f"  [{r.index}] {r.name} {r.uuid}: {fields}")
    gpus = 0 if args.cpu_smoke else len(readings)
    if not gpus and not args.cpu_smoke:
        print("gpu_check=failed (NVML sees no GPU here)")
        return 1

    import ray
    from mlflow.tracking import MlflowClient

    from towerflow.launch import train
    from towerflow.tracking.cluster_gpus import format_table, probe_cluster

    ensure_mnist(workdir / "mnist", log, shards=4, examples=20000, eval_examples=0)
    # Logical CPUs enough for the job's actors on a small machine; GPUs as Ray detects them.
    cpus = max(os.cpu_count() or 1, 4)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    print(f"Ray resources: {ray.cluster_resources()}")

    log(f"tracked job: {max(1, gpus)} worker(s), memory growth on, {args.steps} steps")
    result = train(job(args, workdir, gpus, "gpu-check", ["tf_config.memory_growth=true"]))
    print(f"\n{result.summary_line()}")
    for w in result.workers:
        print(f"  worker {w['worker']}: devices {w['devices']}, TF peak MiB {w['gpu_peak_mb']}")
        if gpus and not any("GPU" in d.upper() for d in w["devices"]):
            failures.append(f"worker {w['worker']} trained on {w['devices']}, not a GPU")
    metrics = MlflowClient(f"sqlite:///{workdir}/mlflow.db").get_run(result.run_id).data.metrics
    gpu_metrics = {k: v for k, v in metrics.items() if k.startswith("system/") and "gpu" in k}
    print(f"\nMLflow system metrics of run {result.run_id} with 'gpu' in the name: {len(gpu_metrics)}")
    for key in sorted(gpu_metrics):
        print(f"  {key} = {gpu_metrics[key]:g}")
    if gpus and not gpu_metrics:
        failures.append("no system/<node>/gpu_* metrics in the run")

    print("\ntowerflow gpus:")
    print(format_table(probe_cluster()))
    # The driver wrote checkpoints with TensorFlow while the workers trained: on no GPU (tf_import).
    on_gpus = {p.pid for reading in read_gpus() for p in reading.processes}
    if gpus and os.getpid() in on_gpus:
        failures.append(f"the driver (pid {os.getpid()}) holds GPU memory")

    if gpus:
        log(f"job under tf_config.memory_limit_mb={args.memory_limit_mb}")
        limited = train(
            job(
                args,
                workdir,
                gpus,
                "gpu-check-limit",
                ["tf_config.memory_growth=false", f"tf_config.memory_limit_mb={args.memory_limit_mb}"],
            )
        )
        for w in limited.workers:
            peaks = w["gpu_peak_mb"]
            print(f"  limited worker {w['worker']}: TF peak MiB {peaks} (limit {args.memory_limit_mb})")
            if not peaks or max(peaks.values()) > args.memory_limit_mb:
                failures.append(f"worker {w['worker']} peak {peaks} against limit {args.memory_limit_mb} MiB")
    compare_buckets(args, workdir, gpus)
    ray.shutdown()
    print(f"\nworkdir: {workdir}")
    print("gpu_check=ok" if not failures else f"gpu_check=failed ({'; '.join(failures)})")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
