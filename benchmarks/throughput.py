"""Throughput and memory: Keras `model.fit` against towerflow sync (1 and 2 workers) on LeNet.

Same model (models.lenet, Adam 1e-3, sparse CE from logits), same synthetic MNIST TFRecords, same
global batch (256). Rounds interleave the three configurations in rotating order; each run times a
fixed number of steps after a warm-up. Keras runs in a child process (the whole machine to itself);
towerflow runs through `towerflow.launch.train` on one local Ray. A memory part then samples the
RSS of every shard and worker process and Ray's object store during a longer 2-worker run, and
sets a shard's memory against two baselines: a bare TensorFlow actor, and a shard of a model with
next to no variables (benchmarks/tiny_model.py), whose memory is what any shard costs.

    python benchmarks/throughput.py            # 3 rounds x 150 steps, 1,000-step memory run
    python benchmarks/throughput.py --quick    # smoke run
    python benchmarks/throughput.py --skip-throughput   # the memory run alone

The last line is `sync_vs_keras=<2-worker examples/sec / Keras examples/sec>` (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cpu_budget
from common import ensure_mnist, machine, make_log
from memory_probe import MIB, MemorySampler, baseline_memory, print_memory

from towerflow.runtime.events import PHASES
from towerflow.runtime.hooks import Hook

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "pipelines" / "mnist_sync.yaml"
GLOBAL_BATCH = 256
RAY_WORKER_NICENESS = 15
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


log = make_log("throughput")


def measured(runner, args: argparse.Namespace) -> dict:
    """One run, with the CPU other processes used meanwhile (cores, averaged over the run)."""
    cpu_budget.wait_for_quiet(args.quiet_wait, log)
    before, started = cpu_budget.benchmark_snapshot(), time.time()
    result = runner(args)
    result["foreign"] = cpu_budget.foreign_cores(before, time.time() - started)
    return result


# -- Keras model.fit, in a child process ----------------------------------------------------------
def keras_child(data: Path, warmup: int, steps: int) -> None:
    """Runs in the child: tf.data over the same shards, model.fit, one JSON line on stdout."""
    import keras
    import tensorflow as tf

    from models.lenet import build

    image = json.loads((data / "manifest.json").read_text())["features"]["image"]
    features = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(serialized):
        parsed = tf.io.parse_example(serialized, features)
        pixels = tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), [-1, *image["decoded_shape"]])
        return tf.cast(pixels, tf.float32) * image.get("scale", 1 / 255), parsed["label"]

    files = sorted(str(p) for p in data.glob("train-*"))
    ds = tf.data.TFRecordDataset(files, buffer_size=1 << 20).batch(GLOBAL_BATCH, drop_remainder=True)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).cache().repeat().prefetch(tf.data.AUTOTUNE)
    keras.utils.set_random_seed(0)
    model = build(num_classes=10)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    marks: list[float] = []
    cpu: dict[int, dict[str, float]] = {}

    def mark(batch: int, logs) -> None:
        marks.append(time.perf_counter())
        if batch + 1 in (warmup, warmup + steps):
            cpu[batch + 1] = cpu_budget.snapshot(trainer_pid=os.getpid())

    timer = keras.callbacks.LambdaCallback(on_train_batch_end=mark)
    model.fit(ds, steps_per_epoch=warmup + steps, epochs=1, verbose=0, callbacks=[timer])
    span = marks[warmup + steps - 1] - marks[warmup - 1]
    result = {"rate": steps * GLOBAL_BATCH / span, "span_s": span, "jit_compile": model.jit_compile}
    result["cpu"] = cpu_budget.per_step(cpu[warmup], cpu[warmup + steps], steps)
    print(json.dumps(result))


def run_keras(args: argparse.Namespace) -> dict:
    command = ["nice", "-n", str(RAY_WORKER_NICENESS), sys.executable, __file__, "--keras-child"]
    command += ["--data", str(args.data), f"--warmup={args.warmup}", f"--steps={args.steps}"]
    # Same niceness as Ray's workers (the raylet starts them at 15), so other jobs slow both alike.
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the Keras child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- towerflow ------------------------------------------------------------------------------------
class Recorder(Hook):
    """Keeps (step, elapsed_s, examples_seen, time_split) of every step event, and the machine's CPU
    by role at the first and last step of the timed window."""

    def __init__(self, window: tuple[int, int]) -> None:
        self.events: list[tuple[int, float, int, dict[str, float]]] = []
        self.window, self.cpu = window, {}

    def after_run(self, context, event) -> None:
        self.events.append((event.global_step, event.elapsed_s, event.examples_seen, dict(event.time_split)))
        for edge in self.window:
            if event.global_step >= edge and edge not in self.cpu:
                self.cpu[edge] = (event.global_step, cpu_budget.snapshot())

    def cpu_per_step(self) -> dict[str, float]:
        (first, before), (last, after) = (self.cpu[edge] for edge in self.window)
        return cpu_budget.per_step(before, after, last - first)


def towerflow_spec(args: argparse.Namespace, workers: int, max_steps: int, model: str = "models.lenet:build"):
    from towerflow.spec import load_spec

    cpus = args.cpus_1worker if workers == 1 else 1
    overrides = f"""name=bench-sync-{workers}w model.ref={model} data.eval=null data.epochs=null
        data.batch_size={GLOBAL_BATCH // workers} cluster.workers={workers} cluster.ps={args.ps}
        cluster.cpus_per_worker={cpus} cluster.cpus_per_ps=0.5 cluster.data_cpus=1 training.mode=sync
        training.max_steps={max_steps} training.replicas_to_aggregate={workers}
        training.total_num_replicas={workers} export.saved_model=false export.register_as=null
        supervision.eval=null supervision.checkpoint.enabled=false cluster.keep_actors_s=0""".split()
    return load_spec(SPEC, [f"data.train.paths={args.data}/train-*", *overrides, *args.set])


def run_towerflow(args: argparse.Namespace, workers: int) -> dict:
    from towerflow.launch import train

    end = args.warmup + args.steps
    recorder = Recorder((args.warmup, end))
    train(towerflow_spec(args, workers, end + 2), hooks=[recorder], track=False)
    window = [e for e in recorder.events if args.warmup <= e[0] <= end]
    (_, t0, seen0, _), (_, t1, seen1, _) = window[0], window[-1]
    steady = window[1:]
    split = {p: statistics.median(e[3][p] for e in steady) for p in PHASES}
    split["step"] = statistics.median(b[1] - a[1] for a, b in zip(window, window[1:]))
    return {
        "rate": (seen1 - seen0) / (t1 - t0),
        "span_s": t1 - t0,
        "split": split,
        "cpu": recorder.cpu_per_step(),
    }


# -- memory ---------------------------------------------------------------------------------------
def tiny_shard_memory(args: argparse.Namespace, at: int) -> dict[str, int]:
    """Memory of a shard that holds next to nothing (benchmarks/tiny_model.py) at step `at` (the main
    run's first sample): the fixed cost of a shard, which the main shard pays too."""
    from towerflow.launch import train

    sampler = MemorySampler([at])
    train(towerflow_spec(args, 2, at + 2, model="benchmarks.tiny_model:build"), hooks=[sampler], track=False)
    return max(sampler.samples[at]["ps"].values(), key=lambda shard: shard["anon"])


def run_memory(args: argparse.Namespace) -> dict:
    from towerflow.launch import train

    first = min(200, args.memory_steps // 2)
    steps = sorted({*range(first, args.memory_steps, 200), args.memory_steps})
    sampler = MemorySampler(steps)
    base, tiny = baseline_memory(), tiny_shard_memory(args, first)
    result = train(towerflow_spec(args, 2, args.memory_steps + 2), hooks=[sampler], track=False)
    state = sorted((s["variable_bytes"] + s["slot_bytes"] for s in result.shards), reverse=True)
    return {
        "first": first,
        "last": args.memory_steps,
        "steps": steps,
        "baseline": base,
        "tiny": tiny,
        "state": state,
        **sampler.samples,
    }


# -- report ---------------------------------------------------------------------------------------
def print_throughput(results: dict[str, list[dict]]) -> dict[str, float]:
    keras = statistics.median(r["rate"] for r in results["keras"])
    print(f"\n{'configuration':<30}{'ex/s median':>12}{'min':>9}{'max':>9}{'vs keras':>10}{'others':>8}")
    medians = {}
    for name, runs in results.items():
        rates = [r["rate"] for r in runs]
        medians[name] = statistics.median(rates)
        print(
            f"{LABELS[name]:<30}{medians[name]:>12,.0f}{min(rates):>9,.0f}{max(rates):>9,.0f}"
            f"{medians[name] / keras:>10.3f}{max(r['foreign'] for r in runs):>8.2f}"
        )
    print(
        "(others: most CPU cores that processes outside the benchmark used during a run, averaged over it; "
        f"keras jit_compile={results['keras'][0]['jit_compile']})"
    )
    print(
        "\nstep time split, ms (medians per run, then median of runs; push includes apply and the sync wait)"
    )
    print(f"{'configuration':<30}" + "".join(f"{p:>9}" for p in (*PHASES, "step")))
    print(f"{LABELS['keras']:<30}" + " " * 9 * len(PHASES) + f"{GLOBAL_BATCH / keras * 1000:>9.1f}")
    for name in ("tf1", "tf2"):
        row = [statistics.median(r["split"][p] for r in results[name]) * 1000 for p in (*PHASES, "step")]
        print(f"{LABELS[name]:<30}" + "".join(f"{v:>9.1f}" for v in row))
    print_cpu_budget(results)
    return medians


def print_cpu_budget(results: dict[str, list[dict]]) -> None:
    columns = (*cpu_budget.ROLES, "available")
    print(
        "\nCPU per step, core-ms (medians of runs; trainer = the Keras process or the towerflow workers; "
        "available = cores x step time)"
    )
    print(f"{'configuration':<30}" + "".join(f"{c:>10}" for c in columns))
    for name, runs in results.items():
        row = (statistics.median(r["cpu"][c] for r in runs) for c in columns)
        print(f"{LABELS[name]:<30}" + "".join(f"{v:>10.1f}" for v in row))


LABELS = {
    "keras": "keras model.fit (1 process)",
    "tf1": "towerflow sync, 1 worker",
    "tf2": "towerflow sync, 2 workers",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="steps skipped before timing")
    parser.add_argument("--memory-steps", type=int, default=1000)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--skip-throughput", action="store_true", help="only the memory run (no sync_vs_keras line)"
    )
    parser.add_argument("--quick", action="store_true", help="1 round, 60 steps, 300 memory steps")
    parser.add_argument("--data", type=Path, default=Path("data/bench-mnist"))
    parser.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument(
        "--object-store-mb",
        type=int,
        default=None,
        help="size of the local Ray's object store (Ray's default: 30%% of RAM)",
    )
    parser.add_argument(
        "--ps",
        type=int,
        default=1,
        help="parameter-server shards of the towerflow runs (1 beats 2 for LeNet on 2 cores: docs/benchmarks.md)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="spec override for the towerflow runs"
    )
    parser.add_argument("--cpus-1worker", type=float, default=2, help="cpus_per_worker of the 1-worker run")
    parser.add_argument(
        "--quiet-wait", type=float, default=300, help="seconds to wait for other jobs to calm"
    )
    parser.add_argument("--growth-threshold", type=float, default=5.0, help="RSS growth %% counted as noise")
    parser.add_argument("--keras-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.memory_steps = 1, 60, 300
    args.data = args.data if args.data.is_absolute() else ROOT / args.data
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.keras_child:
        return keras_child(args.data, args.warmup, args.steps)
    os.chdir(ROOT)
    started = time.time()
    import ray

    print(f"# towerflow throughput benchmark, {time.strftime('%Y-%m-%d %H:%M')}\nmachine: {machine()}")
    ensure_mnist(args.data, log)
    ray.init(
        num_cpus=args.ray_cpus,
        object_store_memory=args.object_store_mb * MIB if args.object_store_mb else None,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
    )
    runs = (
        "memory run only"
        if args.skip_throughput
        else f"{args.rounds} round(s) x {args.steps} timed steps after {args.warmup} warm-up; "
        f"1-worker cpus_per_worker={args.cpus_1worker:g}"
    )
    print(
        f"Ray {ray.__version__}, {args.ray_cpus} logical CPUs; global batch {GLOBAL_BATCH}; {runs}; "
        f"{args.ps} PS shard(s) at 0.5 CPU"
    )
    runners = {"keras": run_keras, "tf1": lambda a: run_towerflow(a, 1), "tf2": lambda a: run_towerflow(a, 2)}
    results: dict[str, list[dict]] = {name: [] for name in runners}
    for r in range(0 if args.skip_throughput else args.rounds):
        names = list(runners)[r % 3 :] + list(runners)[: r % 3]
        for name in names:
            log(f"round {r + 1}/{args.rounds}: {LABELS[name]} ...")
            results[name].append(measured(runners[name], args))
            last = results[name][-1]
            log(
                f"  {last['rate']:,.0f} ex/s over {last['span_s']:.1f} s; other processes: {last['foreign']:.2f} cores"
            )
    medians = {} if args.skip_throughput else print_throughput(results)
    memory = None
    if not args.skip_memory:
        log(f"memory run: {args.memory_steps} steps, 2 workers ...")
        memory = print_memory(run_memory(args), args.growth_threshold)
        if medians:
            print(memory)
    print(f"\nwall time of the whole benchmark: {time.time() - started:.0f} s")
    if medians:
        print(f"sync1_vs_keras={medians['tf1'] / medians['keras']:.3f}")
        print(f"sync_vs_keras={medians['tf2'] / medians['keras']:.3f}")
    elif memory:
        print(memory)  # a memory-only run ends with its memory line


if __name__ == "__main__":
    main()
