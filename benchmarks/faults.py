"""Faults injected for real into LeNet runs: what each costs, in sync and async, on one machine
and on a multi-node cluster.

Each fault run is paired with a clean run of the same configuration, interleaved in rounds. On one
local Ray instance (the training run in this process):
- worker killed: SIGKILL of worker 1's process at step `--at`;
- worker hung: SIGSTOP of worker 1 (alive, silent) with training.failure.worker_timeout_s 10;
- parameter server killed: SIGKILL of shard 1 (checkpoints every `--every` steps, memory
  checkpoints off); again with no stored checkpoint within the run, with memory checkpoints every
  `--memory-every-s` and without (a rollback to the start), each against a clean run of its own,
  and the clean run with memory checkpoints against the one without, for what taking them costs;
  and (sync) the same two with one shard and a warm spare shard, which holds the copy, and with
  one shard alone, whose copy a worker holds;
- worker and parameter server killed again with a warm spare (`cluster.spare_workers=1`,
  `cluster.spare_shards=1`), each against a clean run with that spare, and that clean run against
  one without, for what the idle spare costs;
- straggler 3x (sync only): 3 workers, replicas_to_aggregate 2 (one backup worker), worker 2 three
  times slower than the step (a sleep of 2 x `--step-s` on top of its LeNet step), against the same
  run with no slow worker. Not meaningful on 2 cores: three LeNet workers oversubscribe them, and a
  worker slowed by a sleep frees a core for the other two;
- straggler 3x, simulated compute (sync, 1 backup): the same 3 workers with a 7,850-parameter model
  (benchmarks/tiny_model.py, `--sim-batch` examples a worker) whose every step sleeps `--sim-step-s`
  (worker 2: three times that) via the FaultInjector, against all three sleeping `--sim-step-s`.
  Sleeping workers do not contend for the cores, so this measures the protocol's tolerance of one
  slow worker (its stale gradients dropped, the backup worker's role): issue 14's "one worker
  slowed 3x costs sync mode at most 10% of its throughput".
Then, after this process's Ray is shut down, on a 3-node local cluster (benchmarks/faults_cluster.py,
drivers started as `python -m towerflow train`): a node holding a worker lost; the driver SIGKILLed
and `--resume auto` started again; an elastic run growing onto a node that joins, then shrinking
when that node is lost.

For each: survived (the run ends FINISHED at max_steps), steps redone, seconds lost (wall time
against the clean run, median of the rounds), the replacement's start or the recovery (loss noticed
to the replacement's first step; a lost parameter server's rollback, loss found to the workers
training again; for the cluster rows see faults_cluster.py) and throughput against the clean run. Figures go to docs/reliability.md.

    python benchmarks/faults.py                    # 1 round: 13 min of single-instance cases, ~20 of cluster ones
    python benchmarks/faults.py --rounds 3
    python benchmarks/faults.py --no-cluster       # the single-instance cases only
    python benchmarks/faults.py --only "node lost" # the cases whose name holds this, with their clean runs
    python benchmarks/faults.py --no-cluster --only "none stored"

The last lines are `straggler_sim_ratio=<ex/s with the simulated straggler / without>` and
`faults_survived=<n>/<n tried>` (every case, single-instance and cluster).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

from common import ensure_mnist, machine, make_log
from faults_cluster_elastic import ELASTIC_STEPS
from faults_cluster_rows import summarize
from faults_cluster_run import run_cluster_cases

from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "pipelines" / "mnist_sync.yaml"
DATA = ROOT / "data" / "bench-mnist"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
log = make_log("faults")
SIM_MODEL = "benchmarks.tiny_model:build"
SIM_BASELINE = "no straggler, simulated compute (sync, 1 backup)"
SIM_STRAGGLER = "straggler 3x, simulated compute (sync, 1 backup)"
NO_MEMORY = "training.failure.memory_checkpoint_every_s=null"
NO_STORED = "supervision.checkpoint.every_steps=1000000"  # none within the run
SPARE = {  # per target: the fault's name, the spare's kind, the override that keeps one
    "worker": {"fault": "worker killed", "kind": "worker", "overrides": ["cluster.spare_workers=1"]},
    "ps": {"fault": "parameter server killed", "kind": "shard", "overrides": ["cluster.spare_shards=1"]},
}


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
        actor = runtime.group.slots[1].actor if self.target == "worker" else runtime.shards[-1]
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
        "cluster.keep_actors_s=0",  # each run starts its own actors: no run's start is another's kept ones
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
        hook.faults.append(f"the run failed: {exc}"[:3000])
    return {
        "wall_s": time.monotonic() - started,
        "survived": survived,
        "examples_per_sec": rate,
        "steps_redone": hook.metrics.get("steps_redone", 0.0),
        "recovery_s": hook.metrics.get("worker_recovery_s", hook.metrics.get("ps_rollback_s")),
        "notes": hook.faults,
    }


def cases(args: argparse.Namespace) -> list[dict]:
    """The single-instance cases; a case with a `baseline` is a table row, the others its clean runs."""
    listed = []
    for mode in ("sync", "async"):
        listed += [
            {"name": f"worker killed ({mode})", "mode": mode, "target": "worker"},
            {"name": f"worker hung ({mode})", "mode": mode, "target": "worker", "signal": signal.SIGSTOP},
            # the stored checkpoint's rollback (every `--every` steps), memory checkpoints off
            {
                "name": f"parameter server killed ({mode})",
                "mode": mode,
                "target": "ps",
                "overrides": [NO_MEMORY],
            },
        ]
        for case in listed[-3:]:
            case["baseline"] = f"clean {mode}"
        # Memory checkpoints with no stored checkpoint within the run (as where stored ones are
        # minutes apart): a lost shard's rollback with them, and without (back to the start).
        memory = f"training.failure.memory_checkpoint_every_s={args.memory_every_s}"
        bare, with_memory = f"clean {mode}, none stored", f"clean {mode}, none stored, memory checkpoints"
        listed += [
            {
                "name": f"parameter server killed, none stored ({mode})",
                "mode": mode,
                "target": "ps",
                "overrides": [NO_STORED, NO_MEMORY],
                "baseline": bare,
            },
            {
                "name": f"parameter server killed, none stored, memory checkpoints ({mode})",
                "mode": mode,
                "target": "ps",
                "overrides": [NO_STORED, memory],
                "baseline": with_memory,
            },
            # what taking them costs while training
            {"name": with_memory, "mode": mode, "overrides": [NO_STORED, memory], "baseline": bare},
            {"name": bare, "mode": mode, "overrides": [NO_STORED, NO_MEMORY]},
        ]
        if mode == "sync":  # one shard: its warm spare holds the memory checkpoint's copy, else a worker
            for spares, layout in ((1, "one shard and a spare"), (0, "one shard")):
                one = ["cluster.ps=1", f"cluster.spare_shards={spares}", NO_STORED]
                clean_one = f"clean sync, {layout}, none stored"
                listed += [
                    {
                        "name": f"parameter server killed, {layout}, none stored, memory checkpoints (sync)",
                        "mode": mode,
                        "target": "ps",
                        "overrides": [*one, memory],
                        "baseline": f"{clean_one}, memory checkpoints",
                    },
                    {
                        "name": f"parameter server killed, {layout}, none stored (sync)",
                        "mode": mode,
                        "target": "ps",
                        "overrides": [*one, NO_MEMORY],
                        "baseline": clean_one,
                    },
                    {"name": f"{clean_one}, memory checkpoints", "mode": mode, "overrides": [*one, memory]},
                    {"name": clean_one, "mode": mode, "overrides": [*one, NO_MEMORY]},
                ]
        for target, spare in SPARE.items():
            clean = f"clean {mode}, a warm spare {spare['kind']}"
            listed += [
                {
                    "name": f"{spare['fault']}, warm spare ({mode})",
                    "mode": mode,
                    "target": target,
                    "overrides": spare["overrides"],
                    "baseline": clean,
                },
                # the idle spare's own cost: its start beside the others', its process while training
                {"name": clean, "mode": mode, "overrides": spare["overrides"], "baseline": f"clean {mode}"},
            ]
    straggler = ["cluster.workers=3", "training.replicas_to_aggregate=2", "training.total_num_replicas=3"]
    simulated = [*straggler, f"model.ref={SIM_MODEL}", f"data.batch_size={args.sim_batch}"]
    d = args.sim_step_s
    listed += [
        {"name": "clean sync", "mode": "sync"},
        {"name": "clean async", "mode": "async"},
        {"name": "no straggler (sync, 1 backup)", "mode": "sync", "overrides": straggler},
        {
            "name": "straggler 3x (sync, 1 backup)",
            "mode": "sync",
            "overrides": straggler,
            "delays": {2: 2 * args.step_s},  # its step takes three times the others'
            "baseline": "no straggler (sync, 1 backup)",
        },
        {
            "name": SIM_BASELINE,
            "mode": "sync",
            "overrides": simulated,
            "delays": {0: d, 1: d, 2: d},
        },
        {
            "name": SIM_STRAGGLER,
            "mode": "sync",
            "overrides": simulated,
            "delays": {0: d, 1: d, 2: 3 * d},
            "baseline": SIM_BASELINE,
        },
    ]
    return listed


def select(listed: list[dict], only: list[str] | None) -> list[dict]:
    """The rows whose name holds one of `only`, with their clean runs (all when `only` is None)."""
    rows = [c for c in listed if "baseline" in c and (not only or any(o in c["name"] for o in only))]
    wanted = {c["name"] for c in rows} | {c["baseline"] for c in rows}
    return [c for c in listed if c["name"] in wanted]


def run_single_instance(listed: list[dict], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every case of `listed` once a round (rounds rotated), on one local Ray instance."""
    import tempfile

    import ray

    ray.init(num_cpus=6, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    runs: dict[str, list[dict]] = {}
    try:
        for round_ in range(args.rounds):
            order = listed[round_ % len(listed) :] + listed[: round_ % len(listed)]
            for case in order:
                log(f"round {round_ + 1}: {case['name']}")
                with tempfile.TemporaryDirectory() as tmp:
                    runs.setdefault(case["name"], []).append(run_once(case, args, Path(tmp)))
                log(f"  {runs[case['name']][-1]}")
    finally:
        ray.shutdown()  # the cluster cases drive a Ray of their own, through subprocesses
    return runs


def table_line(row: dict) -> str:
    survived = {True: "yes", False: "NO", None: "not tried"}[row["survived"]]
    redone = "-" if row["steps_redone"] is None else f"{row['steps_redone']:.0f}"
    lost = row["lost"]
    lost_text = f"{statistics.median(lost):+.1f} ({min(lost):+.1f} .. {max(lost):+.1f})" if lost else "-"
    recovery = f"{statistics.median(row['recovery']):.1f}" if row["recovery"] else "-"
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
    return f"| {row['name']} | {survived} | {redone} | {lost_text} | {recovery} | {ratio} |"


def print_report(rows: list[dict], args: argparse.Namespace, cluster_rows: int) -> None:
    print(f"# faults: {machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(
        f"# LeNet, global batch 256, {args.steps} steps, fault at step {args.at}, checkpoint every "
        f"{args.every}; elastic runs {args.elastic_steps} steps; memory checkpoints every "
        f"{args.memory_every_s} s in their rows (off in the other parameter-server rows, which roll back "
        "to the stored checkpoint)"
    )
    if any(row["name"] == SIM_STRAGGLER for row in rows):
        print(
            f"# {SIM_STRAGGLER}: a {SIM_MODEL} model whose every step sleeps {args.sim_step_s} s "
            f"(worker 2: {3 * args.sim_step_s:.1f} s) in place of its compute. Sleeping workers do not "
            "contend for this machine's cores, so the row measures the protocol's tolerance of one "
            "slow worker (the backup worker's stale gradients dropped), not the machine's share of CPU."
        )
    if cluster_rows:
        print(
            "# node, driver and elastic rows: a 3-node local Ray cluster (2 CPUs a node), the driver "
            "run as `python -m towerflow train`; recovery: worker_recovery_s, the restarted driver's "
            "first step, or the node's join or loss to the `workers` metric's change"
        )
    print(
        "| fault | survived | steps redone | seconds lost (median, range) | replacement / recovery s "
        "| ex/s vs clean |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(table_line(row))
    for row in rows:
        for note in row["notes"]:
            print(f"# {row['name']}, {' // '.join(note.strip().splitlines())}")
    sim = next((row["ratio"] for row in rows if row["name"] == SIM_STRAGGLER), None)
    print(f"straggler_sim_ratio={'n/a' if sim is None else f'{sim:.2f}'}")
    tried = [row for row in rows if row["survived"] is not None]
    print(f"faults_survived={sum(bool(row['survived']) for row in tried)}/{len(tried)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=120, help="max_steps of every run")
    parser.add_argument("--at", type=int, default=50, help="the global step at which the fault is injected")
    parser.add_argument("--every", type=int, default=40, help="checkpoint interval (steps)")
    parser.add_argument(
        "--memory-every-s", type=float, default=2.0, help="memory checkpoints' interval, in their cases"
    )
    parser.add_argument(
        "--step-s", type=float, default=0.5, help="a LeNet step here, for the straggler's delay"
    )
    parser.add_argument(
        "--sim-step-s", type=float, default=0.3, help="the simulated straggler case's step (a sleep)"
    )
    parser.add_argument("--sim-batch", type=int, default=32, help="its batch per worker")
    parser.add_argument(
        "--elastic-steps", type=int, default=ELASTIC_STEPS, help="max_steps of the elastic runs"
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=8.0,
        help="the shard's-node rows: seconds from the drain notice (step --at) to the node's loss",
    )
    parser.add_argument("--no-cluster", action="store_true", help="skip the multi-node cluster cases")
    parser.add_argument(
        "--only",
        metavar="NAME_SUBSTRING",
        action="append",
        help="only the cases whose name holds this (given again: or that)",
    )
    args = parser.parse_args()

    ensure_mnist(DATA, log)
    log(machine())
    listed = select(cases(args), args.only)
    runs = run_single_instance(listed, args) if listed else {}
    rows = [summarize(c["name"], runs[c["name"]], runs[c["baseline"]]) for c in listed if "baseline" in c]
    cluster_rows = [] if args.no_cluster else run_cluster_cases(args, log)
    print_report(rows + cluster_rows, args, len(cluster_rows))


if __name__ == "__main__":
    main()
