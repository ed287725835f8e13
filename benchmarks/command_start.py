"""A `towerflow train` command as a user types it: this tree against another commit's, interleaved.

Each run is `python -m towerflow train pipelines/mnist_sync.yaml` for a few steps (1 worker, 1
shard, no evaluation or export), a fresh process on its own embedded Ray, as `make example` runs;
its tracking store is one per tree, made by an untimed first run (a new store's migrations are a
first run's cost only). Per run: seconds from the command to its exit, and the driver's peak RSS
(polled every 0.1 s). The base tree is a temporary git worktree of `--base`; each round runs both
trees, in alternating order.

    python benchmarks/command_start.py --base HEAD~1 --rounds 5

The last line is `command_start: new_s=<median> base_s=<median> new_vs_base=<median of per-round
ratios> new_driver_mb=<median peak> base_driver_mb=<median peak>`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import ensure_mnist, machine, make_log

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [
    "cluster.workers=1",
    "cluster.ps=1",
    "training.replicas_to_aggregate=1",
    "training.total_num_replicas=1",
    "data.epochs=null",
    "supervision.eval=null",
    "export.saved_model=false",
]

log = make_log("command_start")


def run_command(tree: Path, data: Path, store: str, steps: int) -> tuple[float, float]:
    """(seconds to exit, driver's peak RSS in MB) of one `towerflow train` from `tree`."""
    settings = [*SETTINGS, f"data.train.paths={data}/train-*", f"data.eval.paths={data}/eval-*"]
    settings.append(f"training.max_steps={steps}")
    command = [sys.executable, "-m", "towerflow", "train", "pipelines/mnist_sync.yaml", "--no-progress"]
    command += [arg for setting in settings for arg in ("--set", setting)]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env |= {"PYTHONPATH": str(tree / "platform"), "MLFLOW_TRACKING_URI": store, "TF_CPP_MIN_LOG_LEVEL": "2"}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    driver, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        with contextlib.suppress(psutil.Error):  # between the exit and the poll
            peak = max(peak, driver.memory_info().rss)
        time.sleep(0.1)
    elapsed = time.perf_counter() - start
    output = process.stdout.read().decode(errors="replace")
    if process.returncode != 0 or f"finished steps={steps}" not in output:
        raise RuntimeError(f"{tree}: exit {process.returncode}\n{output[-3000:]}")
    return elapsed, peak / (1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare against (default HEAD)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    print(f"# towerflow command start-up, {time.strftime('%Y-%m-%d %H:%M')}, base {args.base}")
    print(f"machine: {machine()}")
    data = ROOT / "data" / "bench-startup"
    ensure_mnist(data, log, shards=2, examples=4096, eval_examples=512)
    samples: dict[str, list[tuple[float, float]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="towerflow-command-start-") as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True)
        try:
            trees = {"base": base, "new": ROOT}
            stores = {side: f"sqlite:///{scratch}/{side}.db" for side in trees}
            for side, tree in trees.items():  # each store's migrations, and warm file caches: not timed
                run_command(tree, data, stores[side], args.steps)
            for round_ in range(args.rounds):
                for side in ("base", "new") if round_ % 2 == 0 else ("new", "base"):
                    seconds, peak_mb = run_command(trees[side], data, stores[side], args.steps)
                    samples[side].append((seconds, peak_mb))
                    log(f"round {round_ + 1} {side}: {seconds:.1f} s, driver peak {peak_mb:,.0f} MB")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)

    print(f"\n{args.rounds} interleaved rounds, medians (min - max)")
    print(f"{'tree':<6} {'command s':>22} {'driver peak MB':>22}")
    for side, runs in samples.items():
        seconds, peaks = zip(*runs, strict=True)
        print(f"{side:<6} {_spread(seconds, '.1f'):>22} {_spread(peaks, ',.0f'):>22}")
    ratios = [n[0] / b[0] for n, b in zip(samples["new"], samples["base"], strict=True)]
    print(f"new / base per round: {', '.join(f'{r:.3f}' for r in ratios)}")
    medians = {
        side: [statistics.median(column) for column in zip(*runs, strict=True)]
        for side, runs in samples.items()
    }
    print(
        f"command_start: new_s={medians['new'][0]:.2f} base_s={medians['base'][0]:.2f} "
        f"new_vs_base={statistics.median(ratios):.3f} new_driver_mb={medians['new'][1]:.0f} "
        f"base_driver_mb={medians['base'][1]:.0f}"
    )


def _spread(samples, spec: str) -> str:
    return f"{statistics.median(samples):{spec}} ({min(samples):{spec}}-{max(samples):{spec}})"


if __name__ == "__main__":
    main()
