"""`make bench`: towerflow beside its peers in one run, and the report in docs/benchmarks.md.

Systems (benchmarks/peers/): single-process Keras, towerflow sync and async (1, 2 and 4 workers),
Ray Train's TensorflowTrainer, TensorFlow's ParameterServerStrategy, and a naive driver-relayed Ray
parameter server; workloads: LeNet at global batch 256 (compute-bound) and the 784-500-10 MLP at
64 (communication-bound), on the same synthetic MNIST. Each run is a fresh process; the runs that
a target ratio compares repeat in every round, in rotating order. Every run saves its weights every
few steps and one evaluator scores them all, for time to a target accuracy and eval loss against
training time.

    python benchmarks/bench.py              # 2 rounds, writes docs/benchmarks.md and docs/img/bench-*.png
    python benchmarks/bench.py --rounds 1 --no-docs     # a quick look

Then the cost model's constants are measured (benchmarks/costmodel.py) and the model is checked
against every towerflow run and projected to 256 workers. The last lines: vs_raytrain=,
vs_psstrategy=, async_vs_sync_mlp=, async_fetch2_vs_sync_mlp=, async_overlap_vs_sync_mlp=,
async_vs_sync=, sync_vs_keras=, model_error_max=.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import costmodel  # noqa: E402
import costmodel_report  # noqa: E402
from common import ensure_mnist, machine, make_log, source_revision  # noqa: E402
from cpu_budget import wait_for_quiet  # noqa: E402
from peers import report  # noqa: E402
from peers.plan import SYSTEMS, Run, default_plan, evaluate, make_run, rounds_of  # noqa: E402
from peers.workloads import ROOT, Evaluator  # noqa: E402

log = make_log("bench")
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- make bench: begin -->", "<!-- make bench: end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "bench-mnist")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench", help="run logs and snapshots")
    parser.add_argument("--only", nargs="*", default=None, help="configuration keys or parts of them to run")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--quiet-wait", type=float, default=60, help="seconds to wait for other jobs to calm")
    parser.add_argument("--no-docs", action="store_true", help="print the report only")
    parser.add_argument(
        "--render-from",
        type=Path,
        default=None,
        help="a former run's folder (its runs.json, costs.json): write the report again without running",
    )
    return parser.parse_args(argv)


def run_all(args: argparse.Namespace) -> tuple[list[Run], list[dict]]:
    """Every round's runs, and after each round the cost model's overhead term: a 7,850-parameter
    model's towerflow step, sync and async, timed in the rounds it is to predict (it moves with the
    machine's hour as much as the runs do)."""
    plan = default_plan()
    if args.only:
        plan = [c for c in plan if any(part in c.key for part in args.only)]
    rounds = rounds_of(plan, args.rounds)
    total = sum(len(r) for r in rounds)
    evaluators: dict[str, Evaluator] = {}
    runs: list[Run] = []
    overheads: list[dict] = []
    for number, configs in enumerate(rounds, start=1):
        for turn in configs:
            config = turn.config
            load = wait_for_quiet(args.quiet_wait, log, window_s=1.0)
            kind = ("" if turn.snapshots else " (timed)") if turn.timed else " (snapshots)"
            log(
                f"[{len(runs) + 1}/{total}] round {number}: {config.key}{kind} (others used {load:.2f} cores) ..."
            )
            run = make_run(turn, number, args.data, args.out, args.run_timeout)
            if run.ok and SYSTEMS[config.system].probe:
                log(f"  {'; '.join(run.report.get('notes', []))[:300]}")
            elif run.ok:
                if config.workload not in evaluators:
                    evaluators[config.workload] = Evaluator(config.workload, args.data, examples=1024)
                evaluate(run, evaluators[config.workload])
                best = max((e[3] for e in run.evals), default=None)
                scored = "no snapshots" if best is None else f"best eval accuracy {best:.3f}"
                log(
                    f"  {run.report['rate']:,.0f} ex/s, start-up {run.report['startup_s']:.1f} s, "
                    f"{scored}, {run.wall_s:.0f} s in all"
                )
            else:
                log(f"  FAILED: {run.error} (log: {args.out / (run.folder.name + '.log')})")
            runs.append(run)
        wait_for_quiet(args.quiet_wait, log, window_s=1.0)
        log(f"round {number}: the cost model's overhead term (a 7,850-parameter model, sync and async) ...")
        try:
            overheads.append({mode: costmodel.measure_overhead(mode) for mode in ("sync", "async")})
        except RuntimeError as failed:
            log(f"  FAILED: {str(failed)[:300]}")
    return runs, overheads


def measure_costs(args: argparse.Namespace, overheads: list[dict]) -> dict | None:
    """The cost model's constants, in a fresh process (benchmarks/costmodel.py measure), with the
    overhead term as the median of the rounds' (measured here when no round gave one)."""
    wait_for_quiet(args.quiet_wait, log)
    log("cost model: measuring a step's parts ...")
    out = args.out / "costs.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "costmodel.py"), "measure", f"--out={out}"]
    command += ["--no-overhead"] if overheads else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    (args.out / "costs.log").write_text(done.stderr[-200_000:])
    if done.returncode != 0:
        log(f"  FAILED (exit {done.returncode}; log: {args.out / 'costs.log'})")
        return None
    found = json.loads(out.read_text())
    if overheads:
        found["overhead"] = {
            mode: _median_overhead([o[mode] for o in overheads]) for mode in ("sync", "async")
        }
        out.write_text(json.dumps(found, indent=1))
    return found


def _median_overhead(rounds: list[dict]) -> dict:
    """One mode's overhead runs of every round: the medians, and the step of each round."""
    roles = rounds[0]["cpu_per_batch"]
    return {
        **rounds[0],
        "seconds_per_batch": statistics.median(r["seconds_per_batch"] for r in rounds),
        "cpu_per_batch": {
            role: statistics.median(r["cpu_per_batch"][role] for r in rounds) for role in roles
        },
        "other_cores": statistics.median(r["other_cores"] for r in rounds),
        "per_round": [r["seconds_per_batch"] for r in rounds],
    }


def cost_model_section(found: dict, figures: dict, img: Path, rel: str) -> tuple[list[str], float]:
    checked = costmodel_report.check(found, figures)
    projected = costmodel_report.project(found)
    costmodel_report.plot_check(checked, img / "bench-model-check.png")
    costmodel_report.plot_projection(projected, img / "bench-scaling.png")
    worst = max((abs(r["error"]) for r in checked), default=float("nan"))
    parts = [
        "",
        "### Cost model (platform/towerflow/runtime/cost_model.py)",
        "",
        "Constants: each part of a step timed alone (benchmarks/costmodel.py), and the platform's own "
        "time and CPU by process from a near-empty model's runs timed after each round:",
        "",
        costmodel_report.constants_table(found),
        "",
        f"Against every towerflow run above (this machine's {os.cpu_count()} cores shared by all processes; "
        f"worst error {worst:.0%}):",
        "",
        costmodel_report.check_table(checked),
        "",
        "Projected, each worker and shard on a machine of its own on a 25 Gbit/s network, "
        "half the benchmark's global batch per worker (it grows with the workers):",
        "",
        costmodel_report.projection_table(projected),
        "",
        f"![predicted against measured]({rel}/bench-model-check.png)",
        f"![predicted scaling]({rel}/bench-scaling.png)",
    ]
    return parts, worst


def render(
    runs: list[Run],
    found: dict | None,
    args: argparse.Namespace,
    started: float,
    elapsed: float,
    source: str,
    img: Path,
) -> tuple[str, dict]:
    figures = report.collect(runs)
    targets, values = report.targets_table(figures)
    img.mkdir(parents=True, exist_ok=True)
    report.plot_throughput(figures, img / "bench-throughput.png")
    report.plot_loss(figures, img / "bench-loss.png")
    rel = os.path.relpath(img, DOCS.parent)
    parts = [
        f"## Peers, `make bench` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))})",
        "",
        f"Machine: {machine()}. Source: {source}. {args.rounds} interleaved round(s); {len(runs)} runs, each a fresh process; "
        f"{elapsed / 60:.1f} minutes in all. Ratios are of medians measured in this run; "
        "absolute figures hold for this machine and hour only. Snapshots for time to accuracy are "
        "saved off the clock by Keras, Ray Train and the naive PS; towerflow and ParameterServerStrategy "
        "read theirs while training on, so on LeNet they are timed in runs without snapshots and "
        "scored for accuracy in one more run that takes them (benchmarks/peers/plan.py).",
        "",
        "### Targets",
        "",
        targets,
    ]
    missed = report.missed_targets(figures, args.cores)
    if missed:
        parts += ["", "Each missed target, from this run's own figures:", "", missed]
    for workload in ("lenet", "mlp"):
        if not any(f.config.workload == workload for f in figures.values()):
            continue
        parts += [
            "",
            f"### {workload}: examples/sec",
            "",
            report.throughput_table(figures, workload),
            "",
            f"Step split of the systems that report one (ms, medians; {workload}):",
            "",
            report.split_table(figures, workload),
            "",
            f"CPU per global batch by process (ms, medians; {workload}):",
            "",
            report.cpu_table(figures, workload, args.cores),
            "",
            report.accuracy_table(figures, workload),
        ]
    found_by_probes = report.findings(runs)
    if found_by_probes:
        parts += ["", "### Findings", "", found_by_probes]
    parts += [
        "",
        f"![examples/sec per system]({rel}/bench-throughput.png)",
        f"![eval loss against training time]({rel}/bench-loss.png)",
    ]
    if found is not None:
        section, values["model_error_max"] = cost_model_section(found, figures, img, rel)
        parts += section
    return "\n".join(parts), values


def write_docs(section: str) -> None:
    """Replace the generated section of docs/benchmarks.md (kept above the hand-written history)."""
    text = DOCS.read_text()
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.DOTALL)
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{block}\n{rest}"
    DOCS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    os.chdir(ROOT)
    print(f"# towerflow peers benchmark, {time.strftime('%Y-%m-%d %H:%M')}\nmachine: {machine()}", flush=True)
    if args.render_from:
        saved = json.loads((args.render_from / "runs.json").read_text())
        runs = [Run.from_dict(r) for r in saved["runs"]]
        started, elapsed = saved["started"], saved["elapsed_s"]
        source = saved.get("source", "not recorded")
        costs = args.render_from / "costs.json"
        found = json.loads(costs.read_text()) if costs.is_file() else None
        args.rounds = max(r.round for r in runs)
        args.cores = saved.get("cores", os.cpu_count() or 1)  # the machine's that ran them
    else:
        source = source_revision(ROOT)  # before the run rewrites docs/benchmarks.md
        args.cores = os.cpu_count() or 1
        ensure_mnist(args.data, log)
        shutil.rmtree(args.out, ignore_errors=True)
        args.out.mkdir(parents=True)
        runs, overheads = run_all(args)
        found = measure_costs(args, overheads)
        elapsed = time.time() - started
        saved = {
            "started": started,
            "elapsed_s": elapsed,
            "source": source,
            "cores": args.cores,
            "runs": [r.to_dict() for r in runs],
        }
        (args.out / "runs.json").write_text(json.dumps(saved))
    img = (args.out / "img") if args.no_docs else DOCS.parent / "img"
    section, values = render(runs, found, args, started, elapsed, source, img)
    print("\n" + section)
    if not args.no_docs:
        write_docs(section)
        log(f"wrote {DOCS.relative_to(ROOT)} and {img.relative_to(ROOT)}/bench-*.png")
    print()
    keys = (
        "vs_raytrain",
        "vs_psstrategy",
        "async_vs_sync_mlp",
        "async_fetch2_vs_sync_mlp",
        "async_overlap_vs_sync_mlp",
        "async_vs_sync",
        "sync_vs_keras",
        "model_error_max",
    )
    for key in keys:
        value = values.get(key)
        print(f"{key}={'n/a' if value is None else f'{value:.3f}'}")
    return 0 if all(r.ok for r in runs) and found is not None else 1


if __name__ == "__main__":
    sys.exit(main())
