"""`towerflow compare`: the same job in several modes, as child runs of one parent MLflow run.

Each mode trains to its end with towerflow.launch.train (one after the other, on the same cluster);
the parent run then gets PNG plots of loss against wall time and against examples seen, drawn from
the children's metric histories (`elapsed_s`, `examples_seen`, `loss`, all logged with
step = global_step).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from towerflow.errors import SpecError
from towerflow.runtime.hooks import Hook
from towerflow.spec import JobSpec, apply_override, load_spec, validate_spec
from towerflow.tracking.plots import line_plot
from towerflow.tracking.run_metadata import run_tags
from towerflow.tracking.store import ensure_experiment, run_store_uri

MODES = ("sync", "async")
PLOTS = {  # file name: (x metric, x label)
    "loss_vs_wall_time.png": ("elapsed_s", "wall time since the first step (s)"),
    "loss_vs_examples_seen.png": ("examples_seen", "examples seen"),
}


@dataclass
class Comparison:
    parent_run_id: str
    tracking_uri: str
    experiment_id: str
    results: dict[str, Any] = field(default_factory=dict)  # mode -> TrainResult
    plots: list[str] = field(default_factory=list)  # artifact paths in the parent run


def parse_modes(text: str) -> list[str]:
    """`"sync,async"` -> ["sync", "async"]; a SpecError names anything else."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SpecError(f"--modes {text!r}: expected a comma-separated list of {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise SpecError(f"--modes {text!r}: a mode is listed twice")
    return modes


def spec_for_mode(spec: JobSpec | str | Path, mode: str, overrides: Iterable[str] = ()) -> JobSpec:
    """The job spec with `training.mode` set to `mode` (and the run named after it).

    A comparison exports no model unless an override asks for it: each child would otherwise register
    a version and move the alias, and the last mode to finish would win it."""
    overrides = ["export.saved_model=false", *overrides, f"training.mode={mode}"]
    # An async spec's staleness bound, fetch interval and overlap mean nothing in sync mode, and
    # sync refuses them.
    if mode == "sync":
        overrides += ["training.max_staleness=null", "training.fetch_every=1", "training.overlap_push=false"]
    if not isinstance(spec, JobSpec):
        mode_spec = load_spec(spec, overrides)
    else:
        raw = spec.model_dump(mode="json", exclude_unset=True)
        for item in overrides:
            apply_override(raw, item)
        mode_spec = validate_spec(raw, source=f"{spec.name} in mode {mode}")
    base = mode_spec.tracking.run_name or mode_spec.name
    mode_spec.tracking.run_name = f"{base}-{mode}"
    return mode_spec


def compare_modes(
    spec: JobSpec | str | Path,
    modes: Sequence[str] = MODES,
    *,
    overrides: Iterable[str] = (),
    hooks: Sequence[Hook] = (),
) -> Comparison:
    """Train `spec` once per mode as child runs of a new parent run, then plot them into the parent.

    Every mode's spec is validated before anything trains. If a child fails, the parent ends FAILED
    and the error is raised."""
    from mlflow.tracking import MlflowClient

    from towerflow.launch import train

    overrides = list(overrides)
    specs = {mode: spec_for_mode(spec, mode, overrides) for mode in modes}
    first = next(iter(specs.values()))
    uri = run_store_uri(first.tracking.tracking_uri)
    client = MlflowClient(uri)
    experiment_id = ensure_experiment(client, first.experiment, uri)
    tags = {
        **run_tags("compare"),
        "towerflow.job": first.name,
        "towerflow.compare.modes": ",".join(modes),
        "mlflow.runName": f"{first.name}-compare",
    }
    parent = client.create_run(experiment_id, tags=tags).info.run_id
    comparison = Comparison(parent_run_id=parent, tracking_uri=uri, experiment_id=experiment_id)
    status = "FAILED"
    try:
        for mode, mode_spec in specs.items():
            comparison.results[mode] = train(mode_spec, hooks=hooks, parent_run_id=parent)
            if comparison.results[mode].final_loss is not None:
                client.log_metric(parent, f"{mode}.final_loss", comparison.results[mode].final_loss)
            client.log_metric(parent, f"{mode}.examples_per_sec", comparison.results[mode].examples_per_sec)
        comparison.plots = _log_plots(client, parent, {m: r.run_id for m, r in comparison.results.items()})
        status = "FINISHED"
        return comparison
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        client.set_terminated(parent, status=status)


def _log_plots(client: Any, parent: str, run_ids: dict[str, str]) -> list[str]:
    histories = {mode: _history(client, run_id) for mode, run_id in run_ids.items()}
    logged = []
    with tempfile.TemporaryDirectory() as folder:
        for name, (x_metric, x_label) in PLOTS.items():
            series = {}
            for mode, metrics in histories.items():
                xs = metrics.get(x_metric, {})
                steps = [s for s in sorted(metrics.get("loss", {})) if s in xs]
                x = [xs[s] for s in steps]
                if x_metric == "elapsed_s" and x:  # from each run's first step: start-up is not training
                    x = [t - x[0] for t in x]
                series[mode] = (x, [metrics["loss"][s] for s in steps])
            path = line_plot(
                series,
                xlabel=x_label,
                ylabel="training loss",
                title=f"loss vs {x_label}",
                path=Path(folder) / name,
            )
            client.log_artifact(parent, str(path), artifact_path="plots")
            logged.append(f"plots/{name}")
    return logged


def _history(client: Any, run_id: str) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} for the metrics the plots need."""
    return {
        key: {m.step: m.value for m in client.get_metric_history(run_id, key)}
        for key in ("loss", *(x for x, _ in PLOTS.values()))
    }
