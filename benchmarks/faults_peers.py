"""A lost worker and a lost parameter server beside the peers: what each costs towerflow, Ray Train's
TensorflowTrainer and TensorFlow's ParameterServerStrategy, measured in one run.

Every system trains LeNet (global batch 256, 2 workers; the peers benchmark's runners and data,
benchmarks/peers/) for `--batches` global batches, once clean and once with a process SIGKILLed
(by pid) when global batch `--at` is done, interleaved in rounds:
- worker 1 killed: towerflow sync beside Ray Train (synchronous all-reduce: its `FailureConfig`
  restarts every worker from its newest checkpoint, as its fault-tolerance guide has it), and
  towerflow async beside ParameterServerStrategy (its coordinator runs a lost worker's steps on
  the others);
- parameter server 0 killed: towerflow async (the shards roll back to their newest checkpoint)
  beside ParameterServerStrategy (its coordinator raises: the run fails, and is started again).
Every system checkpoints every `--every` global batches in every run, clean ones too (towerflow
and Ray Train to go on from within the run; PSStrategy as its tutorial does, joining the steps in
flight first). A PSStrategy run that fails is started again at once, as its user would, and
resumes from its newest checkpoint: its seconds lost count both processes.

For each fault: survived (the run reached its batches without a restart by hand), seconds lost
(the fault run's time from its first global batch done to its last, less the clean run's of the
same round: start-up, which no fault here touches, swings more than a fault costs), the longest
stall (from the kill, the longest time with no global batch done) and the global batches trained
twice. Figures go to docs/reliability.md.

    python benchmarks/faults_peers.py               # 2 rounds: about 12 minutes on 2 cores
    python benchmarks/faults_peers.py --rounds 3

The last line: `peer_faults_lost_s=` and, per system and fault, `<system>/<fault>:<median seconds
lost>` (`failed` where the run did not survive; `(restarted)` after the figure of runs that were
started again by hand), comma-separated.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from common import ensure_mnist, machine, make_log, source_revision
from cpu_budget import wait_for_quiet
from peers.plan import Config, Run, Steps, Turn, make_run
from peers.workloads import ROOT

log = make_log("faults-peers")
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception)\b.*")


@dataclass(frozen=True)
class Case:
    system: str  # a key of peers.plan.SYSTEMS
    fault: str | None  # "worker", "ps", or None: the clean run
    checkpoints: bool = True  # the system's own, every --every batches
    restart: bool = False  # a failed run is started again as its user would, resuming from them

    @property
    def name(self) -> str:
        return f"{self.system}/{self.fault or 'clean'}"


CASES = [
    Case("towerflow_sync", None),
    Case("towerflow_sync", "worker"),
    Case("raytrain", None),
    Case("raytrain", "worker"),
    Case("towerflow_async", None),
    Case("towerflow_async", "worker"),
    Case("towerflow_async", "ps"),
    Case("psstrategy", None),
    # A PSStrategy run that a fault fails is started again, as its user would; it is reported as
    # failed and restarted, never as survived (a worker's loss it survives on its own, as a rule).
    Case("psstrategy", "worker", restart=True),
    Case("psstrategy", "ps", restart=True),
]
LABELS = {
    "towerflow_sync": "towerflow sync",
    "raytrain": "Ray Train TensorflowTrainer (restarts from a checkpoint)",
    "towerflow_async": "towerflow async",
    "psstrategy": "TF ParameterServerStrategy",
}
FAULTS = {"worker": "worker 1 SIGKILLed", "ps": "parameter server 0 SIGKILLed"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, default=60, help="global batches a run trains")
    parser.add_argument("--at", type=int, default=25, help="the global batch after which the kill comes")
    parser.add_argument("--every", type=int, default=10, help="global batches between checkpoints")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "bench-mnist")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "faults-peers")
    parser.add_argument("--only", nargs="*", default=None, help="systems (or parts of their names) to run")
    parser.add_argument("--run-timeout", type=float, default=400, help="seconds one run may take")
    parser.add_argument("--quiet-wait", type=float, default=60, help="seconds to wait for other jobs to calm")
    return parser.parse_args(argv)


def run_case(case: Case, round_: int, args: argparse.Namespace) -> Run:
    extra = [f"--checkpoint-every={args.every}"] if case.checkpoints else []
    if case.fault:
        extra += [f"--kill={case.fault}", f"--kill-at={args.at}"]
    turn = Turn(Config(case.system, "lenet", 2), snapshots=False)
    steps = Steps(warmup=10, timed=args.batches - 10, snapshot_every=0)
    launch = functools.partial(
        make_run, turn, round_, args.data, args.out, args.run_timeout, steps=steps, extra=extra
    )
    run = launch(tag=f"-{case.fault or 'clean'}")
    if run.ok or not case.restart:
        return run
    # The user's restart: the same command again at once (the kill is done: kill.json says so),
    # resuming from the newest checkpoint; both processes log their batches to one progress.log.
    failed = failure_of(run, args.out)
    again = launch(tag=f"-{case.fault}", log_name=f"{run.folder.name}-restarted", fresh=False)
    again.wall_s += run.wall_s
    again.report["restarted_after"] = failed
    return again


def progress_marks(run: Run) -> list[tuple[int, float]]:
    """(global batch, wall time) of each batch done, as the run's progress.log has them."""
    log_path = run.folder / "progress.log"
    if not log_path.exists():
        return []
    return [
        (int(step), float(wall))
        for step, wall in (line.split() for line in log_path.read_text().splitlines())
    ]


def fault_figures(run: Run) -> dict:
    """From the run's progress log and kill record: the longest stall from the kill on, and the
    global batches done again (a restart or a rollback to an earlier batch)."""
    kill_path, marks = run.folder / "kill.json", progress_marks(run)
    if not kill_path.exists() or not marks:
        return {"stall_s": None, "redone": None}
    killed = json.loads(kill_path.read_text())
    before = [step for step, wall in marks if wall <= killed["wall"]]
    after = sorted(wall for _, wall in marks if wall > killed["wall"])
    walls = [killed["wall"], *after]
    stall = max((b - a for a, b in zip(walls, walls[1:])), default=None)
    first_after = min((step for step, wall in marks if wall > killed["wall"]), default=None)
    # The batch the kill came after, as the killer counted (a peer's rank 0 may log it a moment later)
    reached = max([*before, killed["step"]])
    redone = 0 if first_after is None else max(0, reached - first_after + 1)
    return {"stall_s": stall, "redone": redone}


def training_span(run: Run) -> float:
    """Seconds from the run's first global batch done to its last, its start-up apart (Ray Train's
    runs took 68 to 109 s in all between rounds, a swing larger than what a fault costs); its wall
    time where it logged no batches."""
    walls = [wall for _, wall in progress_marks(run)]
    return max(walls) - min(walls) if len(walls) > 1 else run.wall_s


def failure_of(run: Run, out: Path) -> str:
    """The error a failed run ended on, as its log's last exception line says."""
    log_file = out / f"{run.folder.name}.log"
    lines = log_file.read_text(errors="replace").splitlines() if log_file.exists() else []
    found = [m.group(0) for line in lines if (m := ERROR_LINE.match(line.strip()))]
    return (found[-1] if found else run.error or "failed")[:160]


def summarize(results: dict[str, list[Run]], out: Path) -> list[dict]:
    rows = []
    for case in CASES:
        if case.fault is None or case.name not in results:
            continue
        faulted, clean = results[case.name], results.get(f"{case.system}/clean", [])
        lost, stalls, redone, errors, restarted = [], [], [], [], []
        for run in faulted:
            if not run.ok:
                errors.append(failure_of(run, out))
                continue
            if "restarted_after" in run.report:
                restarted.append(run.report["restarted_after"])
            twin = next((c for c in clean if c.round == run.round and c.ok), None)
            if twin is not None:
                lost.append(training_span(run) - training_span(twin))
            figures = fault_figures(run)
            if figures["stall_s"] is not None:
                stalls.append(figures["stall_s"])
                redone.append(figures["redone"])
        rows.append(
            {
                "system": case.system,
                "fault": case.fault,
                "survived": f"{len(faulted) - len(errors) - len(restarted)}/{len(faulted)}",
                "restarted": sorted(set(restarted)),
                "lost_s": lost,
                "stall_s": stalls,
                "redone": redone,
                "errors": sorted(set(errors)),
            }
        )
    return rows


def spread(values: list[float]) -> str:
    """The median in seconds, with the range where there is more than one round."""
    if not values:
        return "-"
    median = f"{statistics.median(values):.1f} s"
    return median if len(values) == 1 else f"{median} ({min(values):.1f} .. {max(values):.1f})"


def table(rows: list[dict]) -> str:
    lines = [
        "| fault | system | survived | seconds lost (median, range) | longest stall | batches redone | how |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        how = "; ".join(row["errors"]) or "-"
        if row["restarted"]:
            how = f"failed ({'; '.join(row['restarted'])}), restarted by hand from its checkpoint"
        redone = ", ".join(str(r) for r in row["redone"]) or "-"
        lines.append(
            f"| {FAULTS[row['fault']]} | {LABELS[row['system']]} | {row['survived']} | "
            f"{spread(row['lost_s'])} | {spread(row['stall_s'])} | {redone} | {how} |"
        )
    return "\n".join(lines)


def last_line(rows: list[dict]) -> str:
    parts = []
    for row in rows:
        figure = (
            f"{statistics.median(row['lost_s']):.1f}" if row["lost_s"] and not row["errors"] else "failed"
        )
        restarted = "(restarted)" if row["restarted"] else ""
        parts.append(f"{row['system']}/{row['fault']}:{figure}{restarted}")
    return "peer_faults_lost_s=" + ",".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_mnist(args.data, log)
    cases = [c for c in CASES if not args.only or any(part in c.system for part in args.only)]
    log(f"{machine()}; {source_revision(ROOT)}")
    results: dict[str, list[Run]] = {}
    for round_ in range(1, args.rounds + 1):
        # Each round in another order, so that no system always runs in the same minute of a drift.
        shift = (round_ - 1) * 3 % len(cases)
        for case in cases[shift:] + cases[:shift]:
            load = wait_for_quiet(args.quiet_wait, log, window_s=1.0)
            log(f"round {round_}: {case.name} (others used {load:.2f} cores) ...")
            run = run_case(case, round_, args)
            results.setdefault(case.name, []).append(run)
            outcome = f"{run.wall_s:.1f} s" if run.ok else f"FAILED: {failure_of(run, args.out)}"
            figures = fault_figures(run) if case.fault and run.ok else {}
            log(f"  {outcome} {figures or ''}")
    (args.out / "runs.json").write_text(json.dumps({k: [r.to_dict() for r in v] for k, v in results.items()}))
    rows = summarize(results, args.out)
    print(table(rows))
    print(
        f"\n{machine()}; {args.rounds} round(s); LeNet, 2 workers, global batch 256; {args.batches} batches, "
        f"the kill at batch {args.at}, checkpoints every {args.every}"
    )
    print(last_line(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
