"""The driver's memory while checkpointing a model with over 100 MB of state: gathered against sharded.

- gathered: how towerflow checkpointed before the shards wrote their own parts, kept here as the
  baseline: the driver takes every shard's snapshot (`capture_state`), joins them into whole
  variables and writes the checkpoint itself;
- sharded: as the CheckpointSaverHook does now (`save_checkpoint`): each shard writes its own part
  from its own node and the driver writes `meta.json` only.

Each run trains `benchmarks/wide_model.py` (16,000 hidden units: 12.6 M parameters, 151 MB of state
with Adam's slots) on 2 shards and 1 worker and checkpoints every 2 steps, in a fresh process of its
own, so that the driver's peak RSS (VmHWM) is that run's. Reported per mode: the peak before the
first checkpoint, the peak after the last one, and their difference (what checkpointing added), as medians
and ranges over interleaved rounds; the time a checkpoint took; the checkpoint's size on disk.

    python benchmarks/checkpoint_memory.py              # 2 rounds (about 6 min on 2 cores)
    python benchmarks/checkpoint_memory.py --rounds 3 --hidden 32000

The last line is `checkpoint_driver_peak_mb: gathered=<MB> sharded=<MB>` (what checkpointing added).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ensure_mnist, machine, make_log

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "pipelines" / "mnist_sync.yaml"
DATA = ROOT / "data" / "bench-mnist"
MODES = ("gathered", "sharded")
log = make_log("checkpoint_memory")


def _peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_one(mode: str, hidden: int, steps: int, every: int, out: Path) -> dict:
    """One run in this process (a fresh one per run: VmHWM is the process's peak)."""
    from towerflow.checkpoint.stores import LocalCheckpointStore
    from towerflow.launch import train
    from towerflow.runtime.hooks import Hook

    class Peaks(Hook):
        """The driver's peak before the first checkpoint, and the time each checkpoint took."""

        def __init__(self) -> None:
            self.before: float | None = None
            self.after: float | None = None  # right after the last checkpoint (the run's end adds its own)
            self.saves: list[float] = []

        def before_run(self, context, global_step) -> None:
            if self.before is None and context.session.start_step == 0:
                self.before = _peak_mb()

    class Checkpoints(Hook):
        """A checkpoint every `every` steps, gathered by the driver (the baseline) or sharded."""

        def __init__(self, store: LocalCheckpointStore, peaks: Peaks) -> None:
            self.store, self.peaks = store, peaks

        def begin(self, session) -> None:
            session.snapshot_every = every  # the shards keep those steps, as the saver hook asks

        def after_run(self, context, event) -> None:
            if event.global_step % every:
                return
            runtime, position = context.session.runtime, {"examples_seen": event.examples_seen}
            started = time.perf_counter()
            if mode == "gathered":
                self.store.save(runtime.capture_state(event.global_step, position))
            else:
                runtime.save_checkpoint(self.store, event.global_step, position)
            self.peaks.saves.append(time.perf_counter() - started)
            self.peaks.after = _peak_mb()

    peaks = Peaks()
    overrides = [
        "model.ref=benchmarks.wide_model:build",
        f"model.params={{hidden: {hidden}, num_classes: 10}}",
        f"data.train.paths={DATA}/train-*",
        "data.eval=null",
        "supervision.eval=null",
        "export.saved_model=false",
        "data.epochs=null",
        "data.batch_size=64",
        "cluster.workers=1",
        "cluster.ps=2",
        "training.replicas_to_aggregate=1",
        "training.total_num_replicas=1",
        f"training.max_steps={steps}",
        "supervision.log_every_steps=1000",
        "supervision.checkpoint.enabled=false",  # the benchmark's own hook checkpoints
    ]
    store = LocalCheckpointStore(out / "checkpoints")
    hooks = [peaks, Checkpoints(store, peaks)]
    started = time.perf_counter()
    result = train(str(SPEC), overrides=overrides, hooks=hooks, track=False, output_dir=out)
    wall = time.perf_counter() - started
    steps_saved = [step for step, _ in store.list()]
    size = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file()) / max(
        1, len(steps_saved)
    )
    end = peaks.after or _peak_mb()
    return {
        "mode": mode,
        "global_step": result.global_step,
        "checkpoints": steps_saved,
        "before_mb": peaks.before,
        "peak_mb": end,
        "added_mb": end - (peaks.before or end),
        "checkpoint_mb": size / (1 << 20),
        "wall_s": wall,
        "save_s": peaks.saves,
    }


def _child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="tf-ckpt-bench-") as tmp:
        outcome = run_one(args.child, args.hidden, args.steps, args.every, Path(tmp))
    print("RESULT " + json.dumps(outcome), flush=True)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=16000, help="hidden units of the wide model")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    ensure_mnist(DATA, log)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), *sys.path])}
    for round_index in range(args.rounds):
        order = MODES if round_index % 2 == 0 else MODES[::-1]  # interleaved, alternating first
        for mode in order:
            log(f"round {round_index + 1}/{args.rounds}: {mode}")
            command = [sys.executable, __file__, "--child", mode, "--hidden", str(args.hidden)]
            command += ["--steps", str(args.steps), "--every", str(args.every)]
            done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                sys.exit(f"{mode} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            outcome = json.loads(lines[-1][len("RESULT ") :])
            log(f"  {json.dumps(outcome)}")
            results[mode].append(outcome)
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"model: wide_model hidden={args.hidden}; {args.steps} steps, a checkpoint every {args.every}")
    print(
        "| mode | checkpoint (MB) | seconds per checkpoint | driver peak before checkpoints (MB) "
        "| driver peak after checkpoints (MB) | added by checkpointing (MB) |"
    )
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        runs = results[mode]
        print(
            f"| {mode} | {runs[0]['checkpoint_mb']:.0f} | {statistics.median(s for r in runs for s in r['save_s']):.2f} | "
            f"{_spread([r['before_mb'] for r in runs])} | "
            f"{_spread([r['peak_mb'] for r in runs])} | {_spread([r['added_mb'] for r in runs])} |"
        )
    added = {mode: statistics.median(r["added_mb"] for r in results[mode]) for mode in MODES}
    print(f"checkpoint_driver_peak_mb: gathered={added['gathered']:.0f} sharded={added['sharded']:.0f}")


if __name__ == "__main__":
    main()
