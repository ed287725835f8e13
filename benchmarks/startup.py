"""Job start-up: what a job pays before its first steps, on the main example's LeNet.

Every actor, every Ray Data parse worker and the driver is a process of its own that imports
TensorFlow, so on a small machine the import bounds how soon a job trains. Two measurements, in
interleaved rounds, medians reported:

1. Importing TensorFlow in a fresh process: plain `import tensorflow` against towerflow's
   `import_tensorflow()`, which leaves out Keras's optional scikit-learn and matplotlib (CPU and
   wall seconds).
2. A short job end to end: `train()` of pipelines/mnist_sync.yaml for a few steps (no tracking,
   evaluation or export) with 1 worker + 1 shard and with 2 + 2, from the call to its result, on a
   Ray started beforehand (a first, untimed job starts Ray Data's worker processes); and the 2 + 2
   job once more in the actors the same job before it kept (`cluster.keep_actors_s`, an untimed
   job's), as the runs of a sweep in one process start.

    python benchmarks/startup.py            # 5 rounds
    python benchmarks/startup.py --quick    # 2 rounds

The last line is `startup: tf_import_cpu_s=<ours> plain_tf_import_cpu_s=<plain> job_1x1_s=... job_2x2_s=...
job_2x2_kept_s=...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ensure_mnist, machine, make_log

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
IMPORTS = {  # plain first, then ours
    "plain import tensorflow": "import tensorflow",
    "towerflow import_tensorflow()": "from towerflow.tf_import import import_tensorflow; import_tensorflow()",
}
SHAPES = ((1, 1), (2, 2))

log = make_log("startup")


def time_import(code: str) -> tuple[float, float]:
    """(CPU s, wall s) of running `code` in a fresh Python process."""
    script = (
        "import time; cpu, wall = time.process_time(), time.perf_counter()\n"
        f"{code}\n"
        "print(time.process_time() - cpu, time.perf_counter() - wall)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    cpu, wall = done.stdout.split()[-2:]
    return float(cpu), float(wall)


def job_spec(data: Path, workers: int, ps: int, steps: int, keep_actors_s: float = 0):
    from towerflow.spec import load_spec

    return load_spec(
        ROOT / "pipelines" / "mnist_sync.yaml",
        [
            f"data.train.paths={data}/train-*",
            f"data.eval.paths={data}/eval-*",
            "data.epochs=null",
            f"cluster.workers={workers}",
            f"cluster.ps={ps}",
            "cluster.cpus_per_worker=1",  # sizes the benchmark's own Ray below (auto would read that Ray)
            f"training.replicas_to_aggregate={workers}",
            f"training.total_num_replicas={workers}",
            f"training.max_steps={steps}",
            "supervision.eval=null",
            "export.saved_model=false",
            # 0: a job's whole start, new actors, not the last job's kept ones
            f"cluster.keep_actors_s={keep_actors_s}",
        ],
    )


def time_job(spec, runs: str) -> float:
    from towerflow.launch import train

    start = time.perf_counter()
    result = train(spec, track=False, output_dir=tempfile.mkdtemp(dir=runs))
    elapsed = time.perf_counter() - start
    assert result.status == "FINISHED" and result.global_step == spec.training.max_steps, result
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps of each timed job")
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds

    print(f"# towerflow start-up benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"machine: {machine()}")

    imports: dict[str, list[tuple[float, float]]] = {name: [] for name in IMPORTS}
    for r in range(rounds):
        order = list(IMPORTS) if r % 2 == 0 else list(reversed(IMPORTS))
        for name in order:
            imports[name].append(time_import(IMPORTS[name]))
        log(f"imports, round {r + 1}/{rounds}")

    data = ROOT / "data" / "bench-startup"
    ensure_mnist(data, log, shards=2, examples=4096, eval_examples=512)
    import ray

    from towerflow.runtime.actor_pool import release_kept_actors
    from towerflow.runtime.cluster import budget_for

    specs = {shape: job_spec(data, *shape, args.steps) for shape in SHAPES}
    largest = budget_for(specs[SHAPES[-1]].cluster)
    ray.init(num_cpus=largest.cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    runs = tempfile.mkdtemp(prefix="towerflow-startup-")  # the jobs' final checkpoints
    time_job(specs[SHAPES[0]], runs)  # starts Ray Data's worker processes and warms the driver: not timed
    kept = job_spec(data, *SHAPES[-1], args.steps, keep_actors_s=60)
    jobs: dict[tuple[int, int], list[float]] = {shape: [] for shape in SHAPES}
    kept_jobs: list[float] = []
    for r in range(rounds):
        for shape in SHAPES if r % 2 == 0 else reversed(SHAPES):
            jobs[shape].append(time_job(specs[shape], runs))
        time_job(kept, runs)  # leaves its actors: not timed
        kept_jobs.append(time_job(kept, runs))  # takes them
        release_kept_actors()
        log(f"jobs, round {r + 1}/{rounds}")
    ray.shutdown()
    shutil.rmtree(runs, ignore_errors=True)

    print(f"\n{rounds} interleaved rounds, medians (min - max)")
    print(f"{'TensorFlow import in a fresh process':40} {'CPU s':>16} {'wall s':>16}")
    for name, samples in imports.items():
        cpu, wall = zip(*samples)
        print(f"{name:40} {_spread(cpu):>16} {_spread(wall):>16}")
    print(f"\n{f'job of {args.steps} steps, train() to result':40} {'wall s':>16}")
    for (workers, ps), samples in jobs.items():
        print(f"{f'{workers} worker(s) + {ps} shard(s)':40} {_spread(samples):>16}")
    print(f"{'2 + 2, in the actors the last one kept':40} {_spread(kept_jobs):>16}")

    plain, ours = (statistics.median(cpu for cpu, _ in imports[name]) for name in IMPORTS)
    shapes = " ".join(f"job_{w}x{p}_s={statistics.median(jobs[(w, p)]):.2f}" for w, p in SHAPES)
    kept_s = statistics.median(kept_jobs)
    print(
        f"startup: tf_import_cpu_s={ours:.2f} plain_tf_import_cpu_s={plain:.2f} {shapes} job_2x2_kept_s={kept_s:.2f}"
    )


def _spread(samples) -> str:
    return f"{statistics.median(samples):.2f} ({min(samples):.2f}-{max(samples):.2f})"


if __name__ == "__main__":
    main()
