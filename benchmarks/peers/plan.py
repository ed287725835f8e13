"""Which runs the peers benchmark makes, in which order, and how one run is made and read.

Every run is a fresh process (`peer_<runner>.py`), so no system inherits another's threads, memory
or Ray. Configurations compared by a target ratio run in every round, in rotating order; the rest
run once, spread over the rounds so that each round sees the machine's drift alike.

Snapshots (the weights every few batches, scored afterwards for time to accuracy) are the
benchmark's, not the system's: Keras, Ray Train and the naive PS stop their clocks to save one, but
towerflow and ParameterServerStrategy read theirs while the workers train on, on the same two cores.
So on LeNet those two are timed in runs that take no snapshots, and time to accuracy comes from one
more run of theirs that does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peers.workloads import ROOT, Evaluator, read_report

PEERS = ROOT / "benchmarks" / "peers"


@dataclass(frozen=True)
class System:
    label: str
    runner: str  # peer_<runner>.py
    mode: str = "sync"
    extra: tuple[str, ...] = ()  # more arguments for the runner
    probe: bool = False  # a finding (does it run at all?), not a timed run
    snapshots_on_the_clock: bool = False  # its snapshots are read while it trains: they slow it


SYSTEMS = {
    "keras": System("Keras model.fit, 1 process", "keras"),
    "towerflow_sync": System("towerflow sync", "towerflow", "sync", snapshots_on_the_clock=True),
    "towerflow_async": System("towerflow async", "towerflow", "async", snapshots_on_the_clock=True),
    "towerflow_async_fetch2": System(
        "towerflow async, fetch every 2 steps",
        "towerflow",
        "async",
        extra=("--fetch-every=2",),
        snapshots_on_the_clock=True,
    ),
    "towerflow_async_overlap": System(
        "towerflow async, overlapping pushes",
        "towerflow",
        "async",
        extra=("--overlap-push",),
        snapshots_on_the_clock=True,
    ),
    "raytrain": System("Ray Train TensorflowTrainer (tf_keras)", "raytrain"),
    "psstrategy": System(
        "TF ParameterServerStrategy (tf_keras)", "psstrategy", "async", snapshots_on_the_clock=True
    ),
    "naive_ps": System("naive Ray PS (driver-relayed)", "naive_ps"),
    "raytrain_keras3": System(
        "Ray Train TensorflowTrainer with Keras 3", "raytrain", extra=("--keras3-probe",), probe=True
    ),
}


@dataclass(frozen=True)
class Config:
    system: str
    workload: str
    workers: int
    every_round: bool = False  # compared by a target ratio: measured in every round
    rounds: int | None = None  # an every-round configuration measured in the first `rounds` only

    @property
    def snapshots_apart(self) -> bool:
        """Timed in runs without snapshots, and once more with them for time to accuracy: LeNet runs
        of the systems that read snapshots while they train (the MLP's are small and seldom)."""
        return self.workload == "lenet" and SYSTEMS[self.system].snapshots_on_the_clock

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.system}/{self.workers}w"

    @property
    def label(self) -> str:
        workers = "" if self.system == "keras" else f", {self.workers} worker{'s' * (self.workers > 1)}"
        oversubscribed = " (oversubscribed)" if self.workers > (os.cpu_count() or 1) else ""
        return SYSTEMS[self.system].label + workers + oversubscribed


@dataclass(frozen=True)
class Steps:
    warmup: int  # global batches before the timed window
    timed: int  # global batches in it
    snapshot_every: int


STEPS = {
    # 40 batches of warm-up: towerflow's first ones carry its start's tail (Ray Data's first reads,
    # its read process starting), which spent 25-28 ms of CPU per global batch beside the workers,
    # 15-17 after, and cost 5% of the rate when timed from batch 8 (docs/benchmarks.md, session 39).
    # 72 batches in all: every system reaches 90%.
    "lenet": Steps(warmup=40, timed=32, snapshot_every=5),
    "mlp": Steps(warmup=20, timed=600, snapshot_every=30),  # 12 s timed: 4 s swung 0.71-1.17 between rounds
}


def default_plan() -> list[Config]:
    compared = [
        Config(system, "lenet", 1 if system == "keras" else 2, every_round=True)
        for system in ("keras", "towerflow_sync", "towerflow_async", "psstrategy")
    ]
    # Ray Train's run is the longest (50 s of start-up), and its ratio the clearest: two rounds.
    compared.append(Config("raytrain", "lenet", 2, every_round=True, rounds=2))
    compared += [
        Config(s, "mlp", 2, every_round=True)
        for s in ("towerflow_sync", "towerflow_async", "towerflow_async_fetch2", "towerflow_async_overlap")
    ]
    once = [Config("naive_ps", "lenet", 2)]
    once += [Config(f"towerflow_{m}", "lenet", w) for w in (1, 4) for m in ("sync", "async")]
    once += [Config("keras", "mlp", 1), Config("raytrain", "mlp", 2), Config("psstrategy", "mlp", 2)]
    once += [Config("naive_ps", "mlp", 2), Config("raytrain_keras3", "lenet", 2)]
    return compared + once


@dataclass(frozen=True)
class Turn:
    """One run to make: a configuration, timed, or taking snapshots for time to accuracy."""

    config: Config
    snapshots: bool  # False: a timed run of a configuration whose snapshots are apart

    @property
    def timed(self) -> bool:
        """Its rate counts: not the snapshot run of a configuration timed without snapshots."""
        return not (self.config.snapshots_apart and self.snapshots)


def rounds_of(plan: list[Config], rounds: int) -> list[list[Turn]]:
    """Each round: the every-round configurations rotated by the round's number, then its share of
    the others and of the snapshot runs of the configurations timed without them."""
    every = [c for c in plan if c.every_round]
    once = [Turn(c, not c.snapshots_apart) for c in plan if not c.every_round]
    once += [Turn(c, True) for c in plan if c.every_round and c.snapshots_apart]
    rotated = [every[r % len(every) :] + every[: r % len(every)] for r in range(rounds)]
    return [
        [Turn(c, not c.snapshots_apart) for c in turn if c.rounds is None or r < c.rounds] + once[r::rounds]
        for r, turn in enumerate(rotated)
    ]


@dataclass
class Run:
    config: Config
    round: int
    folder: Path
    timed: bool = True  # its rate counts (False: the snapshot run of a configuration timed without)
    report: dict = field(default_factory=dict)
    evals: list[tuple[float, int, float, float]] = field(default_factory=list)  # (train_s, step, loss, acc)
    wall_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return {**asdict(self), "folder": str(self.folder)}

    @classmethod
    def from_dict(cls, saved: dict) -> Run:
        fields = {**saved, "config": Config(**saved["config"]), "folder": Path(saved["folder"])}
        fields["evals"] = [tuple(e) for e in saved["evals"]]
        return cls(**fields)


def make_run(
    turn: Turn,
    round_: int,
    data: Path,
    out: Path,
    timeout_s: float,
    *,
    steps: Steps | None = None,
    extra: Sequence[str] = (),
    tag: str = "",
    log_name: str | None = None,
    fresh: bool = True,
) -> Run:
    """One run in a fresh process, in a folder emptied first: an earlier invocation's checkpoints
    would be resumed from, its kill record would disarm the kill, and its progress log would be
    appended to. `steps` other than the workload's, `extra` arguments (a fault), a `tag` for its
    folder's name, another name for its log and `fresh` False (a run started again, going on in
    the folder its first process left) are for benchmarks/faults_peers.py."""
    config = turn.config
    system, steps = SYSTEMS[config.system], steps or STEPS[config.workload]
    kind = "" if turn.timed else "-snapshots"
    folder = out / f"r{round_}-{config.key.replace('/', '-')}{kind}{tag}"
    log_file = out / f"{log_name or folder.name}.log"
    if fresh and folder.exists():
        shutil.rmtree(folder)
    every = steps.snapshot_every if turn.snapshots else 0
    command = [sys.executable, str(PEERS / f"peer_{system.runner}.py"), f"--workload={config.workload}"]
    command += [f"--workers={config.workers}", f"--data={data}", f"--warmup={steps.warmup}"]
    command += [f"--steps={steps.timed}", f"--snapshot-every={every}", f"--out={folder}"]
    command += [f"--mode={system.mode}", *system.extra, *extra]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    run, started = Run(config, round_, folder, timed=turn.timed), time.time()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as timed_out:
        run.error = f"no result within {timeout_s:.0f} s"
        log_file.write_text(str(timed_out.stderr or "")[-20000:])
        return run
    run.wall_s = time.time() - started
    log_file.write_text(done.stderr[-200_000:])
    try:
        run.report = read_report(done.stdout)
    except ValueError:
        tail = done.stderr.strip().splitlines()[-3:]
        run.error = f"exit {done.returncode}: " + " | ".join(tail)
    if done.returncode != 0 and run.ok:
        run.error = f"exit {done.returncode} after its report"
    return run


def evaluate(run: Run, evaluator: Evaluator) -> None:
    """Eval loss and accuracy of each of the run's snapshots, then the files go (they are large)."""
    for train_s, step, name in run.report.get("snapshots", []):
        path = run.folder / name
        loss, accuracy = evaluator(path)
        run.evals.append((train_s, step, loss, accuracy))
        path.unlink()
