"""A/B: this checkout's towerflow against another commit's, on the bench workloads, interleaved.

A change meant to make a step cheaper is judged here, not in a timed test: the base commit is
checked out into a temporary git worktree, and each round runs every configuration once from each
tree, in alternating order, each run a fresh process (`peers/peer_towerflow.py` of the tree under
test, its `platform/` first on the path, so its Ray workers import that tree's towerflow too).
Medians and per-round ratios, then a machine-readable last line:

    ab: lenet_sync=<new / base examples/sec, median of per-round ratios> lenet_async=... mlp_sync=...

Example: `.venv/bin/python benchmarks/ab.py --base HEAD --rounds 3` for the uncommitted change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_mnist, machine, make_log  # noqa: E402
from peers.plan import STEPS as BENCH_STEPS  # noqa: E402
from peers.workloads import ROOT, read_report  # noqa: E402

# (warm-up, timed) global batches: the bench's windows (a shorter MLP window swings with the hour)
STEPS = {name: (steps.warmup, steps.timed) for name, steps in BENCH_STEPS.items()} | {"tiny": (20, 100)}


def run_once(tree: Path, workload: str, mode: str, workers: int, data: Path, out: Path) -> dict:
    """One peer_towerflow run of `tree`'s code; its report (rate, split, CPU per batch)."""
    warmup, steps = STEPS[workload]
    command = [sys.executable, str(tree / "benchmarks" / "peers" / "peer_towerflow.py")]
    command += [f"--workload={workload}", f"--workers={workers}", f"--mode={mode}", f"--data={data}"]
    command += [f"--warmup={warmup}", f"--steps={steps}", f"--out={out}"]
    path = os.pathsep.join([str(tree / "platform"), str(tree), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{tree.name} {workload} {mode}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return read_report(done.stdout)


def reading(ratios: list[float], band: float = 0.05) -> str:
    """What a config's per-round new/base ratios say: a change shows in every round's ratio on one
    side; rounds that disagree, or all within `band` of 1, are this machine's swing (a single
    3-round median read 0.83 and, an hour later, 0.95 for one and the same code)."""
    if all(r < 1 - band for r in ratios):
        return "slower in every round"
    if all(r > 1 + band for r in ratios):
        return "faster in every round"
    return "rounds disagree: within the swing" if min(ratios) < 1 < max(ratios) else "within the swing"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare against (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--configs",
        default="lenet/sync,lenet/async,mlp/sync,mlp/async",
        help="workload/mode pairs, comma-separated (workloads: lenet, mlp, tiny)",
    )
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "bench-mnist")
    args = parser.parse_args(argv)
    log = make_log("ab")
    configs = [tuple(c.split("/")) for c in args.configs.split(",")]
    ensure_mnist(args.data, log)
    log(machine())
    rates: dict[tuple[str, str], dict[str, list[float]]] = {c: {"base": [], "new": []} for c in configs}
    with tempfile.TemporaryDirectory(prefix="towerflow-ab-") as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True)
        try:
            trees = {"base": base, "new": ROOT}
            for round_ in range(args.rounds):
                for i, (workload, mode) in enumerate(configs):
                    order = ["base", "new"] if (round_ + i) % 2 == 0 else ["new", "base"]
                    for side in order:
                        report = run_once(
                            trees[side], workload, mode, args.workers, args.data, Path(scratch) / "out"
                        )
                        rates[workload, mode][side].append(report["rate"])
                        cpu = report.get("cpu_per_batch", {})
                        log(
                            f"round {round_ + 1} {workload} {mode} {side}: {report['rate']:,.0f} ex/s, "
                            f"CPU per batch (ms) workers {cpu.get('workers', 0) * 1e3:.1f} "
                            f"shards {cpu.get('shards', 0) * 1e3:.1f} other {cpu.get('other', 0) * 1e3:.1f}"
                        )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    print(f"{'config':<14} {'base ex/s':>10} {'new ex/s':>10}  new/base per round")
    summary = []
    for (workload, mode), sides in rates.items():
        ratios = [n / b for n, b in zip(sides["new"], sides["base"], strict=True)]
        print(
            f"{workload + ' ' + mode:<14} {statistics.median(sides['base']):>10,.0f} "
            f"{statistics.median(sides['new']):>10,.0f}  {', '.join(f'{r:.3f}' for r in ratios)}"
            f"  ({reading(ratios)})"
        )
        summary.append(f"{workload}_{mode}={statistics.median(ratios):.3f}")
    print("ab: " + " ".join(summary))


if __name__ == "__main__":
    main()
