"""The peers benchmark's figures: medians and ranges per configuration, the target ratios, tables in
Markdown and PNG plots."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from peers.plan import SYSTEMS, Config, Run
from peers.workloads import WORKLOADS


@dataclass
class Figures:
    """One configuration over its rounds."""

    config: Config
    runs: list[Run]

    @property
    def ok(self) -> list[Run]:
        return [r for r in self.runs if r.ok]

    @property
    def timed(self) -> list[Run]:
        """The runs whose rate counts (a configuration's snapshot run apart: plan.py)."""
        return [r for r in self.ok if r.timed]

    @property
    def with_snapshots(self) -> list[Run]:
        return [r for r in self.ok if r.evals]

    @property
    def rates(self) -> list[float]:
        return [r.report["rate"] for r in self.timed]

    @property
    def rate(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    @property
    def startup_s(self) -> float | None:
        values = [r.report["startup_s"] for r in self.timed]
        return statistics.median(values) if values else None

    def split_ms(self) -> dict[str, float]:
        splits = [r.report.get("split") or {} for r in self.timed]
        phases = splits[0].keys() if splits and splits[0] else ()
        return {p: 1000 * statistics.median(s[p] for s in splits if p in s) for p in phases}

    def cpu_ms(self) -> dict[str, float]:
        """CPU ms per global batch by process role (towerflow's runs), medians over the rounds."""
        found = [r.report.get("cpu_per_batch") or {} for r in self.timed]
        found = [f for f in found if f]
        roles = found[0].keys() if found else ()
        return {role: 1000 * statistics.median(f[role] for f in found) for role in roles}

    def time_to_accuracy(self, target: float, *, from_launch: bool = False) -> tuple[float | None, float]:
        """(median seconds of training to `target` eval accuracy over the runs that reached it, or
        None; the best accuracy any run reached), counted from the end of the first global batch
        (clocks differ in where they start; the first batch's tracing differs little). `from_launch`:
        from the process's start instead, start-up included."""
        reached, best = [], 0.0
        for run in self.with_snapshots:
            hits = [train_s for train_s, _, _, acc in run.evals if acc >= target]
            best = max([best, *(acc for *_, acc in run.evals)])
            if hits:
                origin = run.report.get("first_batch_s", 0.0)
                reached.append(min(hits) - origin + (run.report["startup_s"] if from_launch else 0.0))
        return (statistics.median(reached) if reached else None), best


def collect(runs: list[Run]) -> dict[str, Figures]:
    """The timed configurations' figures (probes apart: `findings`)."""
    grouped: dict[str, list[Run]] = defaultdict(list)
    configs: dict[str, Config] = {}
    for run in runs:
        if SYSTEMS[run.config.system].probe:
            continue
        grouped[run.config.key].append(run)
        configs[run.config.key] = run.config
    return {key: Figures(configs[key], grouped[key]) for key in grouped}


@dataclass(frozen=True)
class Target:
    name: str  # the last line's key
    what: str
    numerator: str  # config keys
    denominator: str
    goal: float


TARGETS = [
    Target(
        "vs_raytrain",
        "towerflow sync / Ray Train, 2 workers, LeNet",
        "lenet/towerflow_sync/2w",
        "lenet/raytrain/2w",
        1.5,
    ),
    Target(
        "vs_psstrategy",
        "towerflow async / TF PSStrategy, 2 workers, LeNet",
        "lenet/towerflow_async/2w",
        "lenet/psstrategy/2w",
        1.3,
    ),
    Target(
        "async_vs_sync",
        "towerflow async / sync, 2 workers, LeNet",
        "lenet/towerflow_async/2w",
        "lenet/towerflow_sync/2w",
        1.0,
    ),
    Target(
        "async_vs_sync_mlp",
        "towerflow async / sync, 2 workers, MLP",
        "mlp/towerflow_async/2w",
        "mlp/towerflow_sync/2w",
        1.0,
    ),
    Target(
        "async_fetch2_vs_sync_mlp",
        "towerflow async fetching every 2nd step / sync, 2 workers, MLP",
        "mlp/towerflow_async_fetch2/2w",
        "mlp/towerflow_sync/2w",
        1.0,
    ),
    Target(
        "async_overlap_vs_sync_mlp",
        "towerflow async overlapping pushes / sync, 2 workers, MLP",
        "mlp/towerflow_async_overlap/2w",
        "mlp/towerflow_sync/2w",
        1.0,
    ),
    Target(
        "sync_vs_keras",
        "towerflow sync, 2 workers / Keras, LeNet",
        "lenet/towerflow_sync/2w",
        "lenet/keras/1w",
        0.85,
    ),
]


def paired_ratios(figures: dict[str, Figures], numerator: str, denominator: str) -> list[float]:
    """The ratio within each round where both ran: the drift between rounds cancels out."""
    if numerator not in figures or denominator not in figures:
        return []
    top = {r.round: r.report["rate"] for r in figures[numerator].timed}
    bottom = {r.round: r.report["rate"] for r in figures[denominator].timed}
    return [top[r] / bottom[r] for r in sorted(top.keys() & bottom.keys())]


def ratio(figures: dict[str, Figures], numerator: str, denominator: str) -> float | None:
    """Median of the numerator's rates over the median of the denominator's."""
    top, bottom = figures.get(numerator), figures.get(denominator)
    if top is None or bottom is None or top.rate is None or bottom.rate is None:
        return None
    return top.rate / bottom.rate


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "n/a" if value is None else pattern.format(value)


def throughput_table(figures: dict[str, Figures], workload: str) -> str:
    rows = [f for f in figures.values() if f.config.workload == workload]
    keras = figures.get(f"{workload}/keras/1w")
    lines = [
        "| system | examples/sec (median) | min | max | runs | vs Keras | step, ms | start-up, s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    batch = WORKLOADS[workload].global_batch
    for f in sorted(rows, key=lambda f: -(f.rate or 0)):
        planned = [r for r in f.runs if r.timed]
        failed = [r.error for r in planned if not r.ok]
        if f.rate is None:
            lines.append(f"| {f.config.label} | failed: {failed[0]} | | | 0/{len(planned)} | | | |")
            continue
        versus = _fmt(f.rate / keras.rate) if keras and keras.rate else "n/a"
        lines.append(
            f"| {f.config.label} | {f.rate:,.0f} | {min(f.rates):,.0f} | {max(f.rates):,.0f} | "
            f"{len(f.timed)}/{len(planned)} | {versus} | {1000 * batch / f.rate:.1f} | {_fmt(f.startup_s, '{:.1f}')} |"
        )
    return "\n".join(lines)


def split_table(figures: dict[str, Figures], workload: str) -> str:
    rows = [(f.config.label, f.split_ms()) for f in figures.values() if f.config.workload == workload]
    rows = [(label, split) for label, split in rows if split]
    if not rows:
        return "(no system reported a step split)"
    phases = list(rows[0][1])
    lines = ["| system | " + " | ".join(phases) + " |", "|---|" + "---:|" * len(phases)]
    lines += [f"| {label} | " + " | ".join(f"{split[p]:.1f}" for p in phases) + " |" for label, split in rows]
    return "\n".join(lines)


def cpu_table(figures: dict[str, Figures], workload: str, cores: int) -> str:
    """Where the CPU of a global batch goes, by process, against its wall time on the machine's cores."""
    rows = [(f, f.cpu_ms()) for f in figures.values() if f.config.workload == workload]
    rows = [(f, cpu) for f, cpu in rows if cpu and f.rate]
    if not rows:
        return "(no system reported its CPU by process)"
    lines = [
        f"| system | workers | shards | other (driver, Ray, data) | all, ms | of the {cores} cores' time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for f, cpu in rows:
        total = sum(cpu.values())
        lines.append(
            f"| {f.config.label} | {cpu['workers']:.1f} | {cpu['shards']:.1f} | {cpu['other']:.1f} | "
            f"{total:.1f} | {_busy(f, total, cores):.0%} |"
        )
    return "\n".join(lines)


def accuracy_table(figures: dict[str, Figures], workload: str) -> str:
    target = WORKLOADS[workload].target_accuracy
    lines = [
        f"| system | seconds of training to {target:.0%} eval accuracy, after the first batch (median) "
        "| from launch, start-up included "
        "| best accuracy seen |",
        "|---|---:|---:|---:|",
    ]
    for f in figures.values():
        if f.config.workload != workload or not f.with_snapshots:
            continue  # (towerflow's 1- and 4-worker LeNet runs are timed without snapshots only)
        seconds, best = f.time_to_accuracy(target)
        launched, _ = f.time_to_accuracy(target, from_launch=True)
        shown = "not reached" if seconds is None else f"{seconds:.1f}"
        lines.append(f"| {f.config.label} | {shown} | {_fmt(launched, '{:.1f}')} | {best:.3f} |")
    return "\n".join(lines)


def targets_table(figures: dict[str, Figures]) -> tuple[str, dict[str, float | None]]:
    lines = [
        "| target | goal | measured (ratio of medians) | per-round ratios | met |",
        "|---|---:|---:|---|---|",
    ]
    values: dict[str, float | None] = {}
    for t in TARGETS:
        value = ratio(figures, t.numerator, t.denominator)
        values[t.name] = value
        rounds = ", ".join(f"{r:.2f}" for r in paired_ratios(figures, t.numerator, t.denominator))
        met = "n/a" if value is None else ("yes" if value >= t.goal else f"no ({value / t.goal - 1:+.0%})")
        lines.append(f"| {t.what} | >= {t.goal} | {_fmt(value)} | {rounds} | {met} |")
    tta = time_to_accuracy_ratio(figures)
    values["tta_vs_raytrain"] = tta
    met = "n/a" if tta is None else ("yes" if tta >= 1.0 else f"no ({tta - 1:+.0%})")
    lines.append(
        "| time to target accuracy, LeNet, 2 workers: Ray Train's / towerflow sync's | >= 1.0 | "
        f"{_fmt(tta)} | | {met} |"
    )
    return "\n".join(lines), values


def _busy(f: Figures, cpu_ms: float, cores: int) -> float:
    """The share of the cores' time that `cpu_ms` of CPU per global batch kept busy at f's rate."""
    return cpu_ms * f.rate / (1000 * cores * WORKLOADS[f.config.workload].global_batch)


def why_missed(figures: dict[str, Figures], target: Target, cores: int) -> str | None:
    """Why a missed target was missed, from this run's own figures; None where it was met.

    On `cores` cores a step cannot take less wall time than its CPU over the cores, so the
    numerator's CPU per global batch bounds its rate, and with it the ratio, whatever it overlaps:
    below the goal, the target is out of reach of this design on this machine; above it, the run
    lost the rest to waiting (idle cores), which the rounds' spread may cover too."""
    value = ratio(figures, target.numerator, target.denominator)
    if value is None or value >= target.goal:
        return None
    top, bottom = figures[target.numerator], figures[target.denominator]
    said = []
    cpu = top.cpu_ms()
    if cpu:
        batch = WORKLOADS[top.config.workload].global_batch
        total = sum(cpu.values())
        busy = _busy(top, total, cores)
        ceiling = 1000 * cores * batch / total / bottom.rate
        parts = ", ".join(f"{role} {ms:.1f}" for role, ms in cpu.items())
        spends = f"{top.config.label} spends {total:.1f} ms of CPU per global batch ({parts})"
        if ceiling < target.goal:
            said.append(
                f"out of reach on {cores} cores. {spends}: with every core busy that is "
                f"{ceiling:.3f}x {bottom.config.label} at most, and the run kept them {busy:.0%} busy"
            )
        else:
            said.append(
                f"within the CPU's reach. {spends}: with every core busy that would be "
                f"{ceiling:.3f}x, but the cores were {busy:.0%} busy, the rest went to waiting"
            )
    rounds = paired_ratios(figures, target.numerator, target.denominator)
    if rounds and max(rounds) >= target.goal:
        said.append(
            f"the rounds' own ratios ran {min(rounds):.2f}-{max(rounds):.2f}: the goal lies within their spread"
        )
    return "; ".join(said) or "no CPU figures to say why"


def missed_targets(figures: dict[str, Figures], cores: int) -> str:
    """A line per missed target: by how much, and why (`why_missed`); empty where all were met."""
    lines = []
    for t in TARGETS:
        why = why_missed(figures, t, cores)
        if why is not None:
            value = ratio(figures, t.numerator, t.denominator)
            lines.append(f"- **{t.what}: {value:.3f} against {t.goal}** ({value / t.goal - 1:+.0%}): {why}.")
    return "\n".join(lines)


def time_to_accuracy_ratio(figures: dict[str, Figures]) -> float | None:
    target = WORKLOADS["lenet"].target_accuracy
    ours, theirs = figures.get("lenet/towerflow_sync/2w"), figures.get("lenet/raytrain/2w")
    if ours is None or theirs is None:
        return None
    (a, _), (b, _) = ours.time_to_accuracy(target), theirs.time_to_accuracy(target)
    return None if a is None or b is None else b / a


def findings(runs: list[Run]) -> str:
    """What the probes found: whether a peer runs at all, and how it fails."""
    lines = []
    for run in runs:
        if not SYSTEMS[run.config.system].probe:
            continue
        said = "; ".join(run.report.get("notes", [])) if run.ok else f"the probe itself failed: {run.error}"
        lines.append(f"- {run.config.label}: {said}")
    return "\n".join(lines)


# -- plots ----------------------------------------------------------------------------------------
def plot_throughput(figures: dict[str, Figures], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({f.config.workload for f in figures.values()})
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rows = sorted(
            (f for f in figures.values() if f.config.workload == workload and f.rate), key=lambda f: f.rate
        )
        medians = [f.rate for f in rows]
        low = [f.rate - min(f.rates) for f in rows]
        high = [max(f.rates) - f.rate for f in rows]
        ax.barh([f.config.label for f in rows], medians, xerr=[low, high], color="#4c72b0", capsize=3)
        ax.set_title(f"{workload}, global batch {WORKLOADS[workload].global_batch}")
        ax.set_xlabel("examples/sec (median; bars: min to max over rounds)")
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss(figures: dict[str, Figures], path: Path) -> None:
    """Eval loss against seconds of training: each configuration's first successful run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({f.config.workload for f in figures.values()})
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for f in figures.values():
            if f.config.workload != workload or not f.with_snapshots:
                continue
            first = f.with_snapshots[0]
            evals, origin = first.evals, first.report.get("first_batch_s", 0.0)
            seconds = [e[0] - origin for e in evals]
            ax.plot(seconds, [e[2] for e in evals], marker="o", markersize=3, label=f.config.label)
        ax.set_title(f"{workload}: eval loss against training time")
        ax.set_xlabel("seconds of training after the first batch")
        ax.set_ylabel("eval loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
