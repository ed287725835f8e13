"""Faults injected for real into LeNet runs: what each costs, in sync and async.

Each fault run is paired with a clean run of the same configuration, interleaved in rounds:
- worker killed: SIGKILL of worker 1's process at step `--at`;
- worker hung: SIGSTOP of worker 1 (alive, silent) with training.failure.worker_timeout_s 10;
- parameter server killed: SIGKILL of shard 1 (checkpoints every `--every` steps);
- straggler (sync only): 3 workers, replicas_to_aggregate 2 (one backup worker), worker 2 three
  times slower than the step (a sleep), against the same run with no slow worker.

For each: survived (the run ends FINISHED at max_steps), steps redone, seconds lost (wall time
against the clean run, median of the rounds), the replacement's start (loss noticed to its first
step) and, for the straggler, throughput against the clean run. Figures go to docs/reliability.md.

    python benchmarks/faults.py                # 1 round, 120 steps (about 15 min on 2 cores)
    python benchmarks/faults.py --rounds 3

The last line is `faults_survived=<n>/<n tried>`.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

from common import ensure_mnist, machine, make_log

from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "pipelines" / "mnist_sync.yaml"
DATA = ROOT / "data" / "bench-mnist"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
log = make_log("faults")


class Inject(Hook):
    """Sends `sig` to a worker's or a shard's process once the chief hears of step `at`."""

    def __init__(self, target: str | None, at: int, sig: int = signal.SIGKILL) -> None:
        self.target, self.at, self.sig = target, at, sig
        self.metrics: dict[str, float] = {}
        self.faults: list[str] = []
        self.injected_at: float | None = None

    def after_run(self, context, event):
        if self.target is None or self.injected_at is not None or event.global_step < self.at:
            return
        import ray

        runtime = context.session.runtime
        actor = runtime.group.slots[1].actor if self.target == "worker" else runtime.shards[1]
        os.kill(ray.get(actor.pid.remote()), self.sig)
        self.injected_at = time.monotonic()

    def on_metrics(self, metrics, step):
        self.metrics.update(metrics)

    def on_fault(self, event):
        self.faults.append(f"{event.what}: {event.action}")


def run_once(case: dict, args: argparse.Namespace, tmp: Path) -> dict:
    from towerflow.launch import train

    overrides = [
        f"data.train.paths={DATA}/train-*",
        "data.eval=null",
        "supervision.eval=null",
        "export.saved_model=false",
        "data.epochs=null",
        f"training.max_steps={args.steps}",
        f"training.mode={case['mode']}",
        f"supervision.checkpoint.every_steps={args.every}",
        "supervision.log_every_steps=1000",
        "training.failure.worker_timeout_s=10",
        *case.get("overrides", []),
    ]
    hook = Inject(case.get("target"), args.at, case.get("signal", signal.SIGKILL))
    faults = FaultInjector(step_delay_s=case["delays"]) if case.get("delays") else None
    started = time.monotonic()
    try:
        result = train(
            str(SPEC), overrides=overrides, hooks=[hook], track=False, output_dir=tmp, faults=faults
        )
        survived = result.global_step == args.steps
        rate = result.examples_per_sec
    except Exception as exc:  # a fault not survived is a result, not a crash of the benchmark
        log(f"{case['name']}: the run failed: {exc}")
        survived, rate = False, 0.0
    return {
        "wall_s": time.monotonic() - started,
        "survived": survived,
        "examples_per_sec": rate,
        "steps_redone": hook.metrics.get("steps_redone", 0.0),
        "recovery_s": hook.metrics.get("worker_recovery_s"),
        "faults": hook.faults,
    }


def cases(args: argparse.Namespace) -> list[dict]:
    straggler = ["cluster.workers=3", "training.replicas_to_aggregate=2", "training.total_num_replicas=3"]
    step_s = args.step_s
    listed = []
    for mode in ("sync", "async"):
        listed += [
            {
                "name": f"worker killed ({mode})",
                "mode": mode,
                "target": "worker",
                "baseline": f"clean {mode}",
            },
            {
                "name": f"worker hung ({mode})",
                "mode": mode,
                "target": "worker",
                "signal": signal.SIGSTOP,
                "baseline": f"clean {mode}",
            },
            {
                "name": f"parameter server killed ({mode})",
                "mode": mode,
                "target": "ps",
                "baseline": f"clean {mode}",
            },
        ]
    listed += [
        {"name": "clean sync", "mode": "sync"},
        {"name": "clean async", "mode": "async"},
        {"name": "no straggler (sync, 1 backup)", "mode": "sync", "overrides": straggler},
        {
            "name": "straggler 3x (sync, 1 backup)",
            "mode": "sync",
            "overrides": straggler,
            "delays": {2: 2 * step_s},  # its step takes three times the others'
            "baseline": "no straggler (sync, 1 backup)",
        },
    ]
    return listed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=120, help="max_steps of every run")
    parser.add_argument("--at", type=int, default=50, help="the global step at which the fault is injected")
    parser.add_argument("--every", type=int, default=40, help="checkpoint interval (steps)")
    parser.add_argument(
        "--step-s", type=float, default=0.5, help="a LeNet step here, for the straggler's delay"
    )
    args = parser.parse_args()
    import tempfile

    import ray

    ensure_mnist(DATA, log)
    ray.init(num_cpus=6, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    log(machine())
    runs: dict[str, list[dict]] = {}
    listed = cases(args)
    for round_ in range(args.rounds):
        order = listed[round_ % len(listed) :] + listed[: round_ % len(listed)]
        for case in order:
            log(f"round {round_ + 1}: {case['name']}")
            with tempfile.TemporaryDirectory() as tmp:
                runs.setdefault(case["name"], []).append(run_once(case, args, Path(tmp)))
            log(f"  {runs[case['name']][-1]}")
    print(f"# faults: {machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(
        f"# LeNet, global batch 256, {args.steps} steps, fault at step {args.at}, checkpoint every {args.every}"
    )
    print(
        "| fault | survived | steps redone | seconds lost (median, range) | replacement start s | ex/s vs clean |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    tried = survived = 0
    for case in listed:
        if "baseline" not in case:
            continue
        mine, base = runs[case["name"]], runs[case["baseline"]]
        lost = [m["wall_s"] - b["wall_s"] for m, b in zip(mine, base)]
        ok = all(m["survived"] for m in mine)
        tried, survived = tried + 1, survived + ok
        recovery = [m["recovery_s"] for m in mine if m["recovery_s"] is not None]
        ratio = statistics.median(m["examples_per_sec"] for m in mine) / max(
            1e-9, statistics.median(b["examples_per_sec"] for b in base)
        )
        print(
            f"| {case['name']} | {'yes' if ok else 'NO'} | {statistics.median(m['steps_redone'] for m in mine):.0f} | "
            f"{statistics.median(lost):+.1f} ({min(lost):+.1f} .. {max(lost):+.1f}) | "
            f"{statistics.median(recovery):.1f} | {ratio:.2f} |"
            if recovery
            else f"| {case['name']} | {'yes' if ok else 'NO'} | "
            f"{statistics.median(m['steps_redone'] for m in mine):.0f} | "
            f"{statistics.median(lost):+.1f} ({min(lost):+.1f} .. {max(lost):+.1f}) | - | {ratio:.2f} |"
        )
    ray.shutdown()
    print(f"faults_survived={survived}/{tried}")


if __name__ == "__main__":
    main()
