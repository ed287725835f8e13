"""The rows of benchmarks/faults_cluster.py: one run's outcome (`result`), a table row from a case's
runs and its clean runs (`summarize`), the LeNet spec every cluster case runs (`write_spec`) and a
clean run of it (`clean_run`)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from faults_driver import ROOT, latest_run, mlflow_client, poll_store, run_outcome, start_driver, tracking_uri

Log = Callable[[str], None]
SPEC = ROOT / "pipelines" / "mnist_sync.yaml"
DATA = ROOT / "data" / "bench-mnist"
# The cluster part of the spec: sized for 2-CPU nodes (1 CPU a worker, 0.5 a shard, 0.5 for Ray Data).
SYNC = {"workers": 2, "ps": 1, "cpus_per_worker": 1, "cpus_per_ps": 0.5, "data_cpus": 0.5}


# -- rows: the shape faults.py prints ---------------------------------------------------------------


def summarize(name: str, mine: list[dict], base: list[dict], ratio: bool = True) -> dict:
    """A table row from a case's runs and its clean runs (paired by round). Each run is a dict of
    wall_s, survived (True, False, or None: not tried), examples_per_sec, steps_redone, recovery_s,
    notes."""
    tried = [m for m in mine if m["survived"] is not None]
    lost = [m["wall_s"] - b["wall_s"] for m, b in zip(mine, base) if m["survived"] is not None]
    rates = [m["examples_per_sec"] for m in tried if m.get("examples_per_sec")]
    base_rates = [b["examples_per_sec"] for b in base if b.get("examples_per_sec")]
    redone = [m["steps_redone"] for m in tried if m.get("steps_redone") is not None]
    return {
        "name": name,
        "survived": all(m["survived"] for m in tried) if tried else None,
        "steps_redone": statistics.median(redone) if redone else None,
        "lost": lost,
        "recovery": [m["recovery_s"] for m in tried if m.get("recovery_s") is not None],
        "ratio": statistics.median(rates) / statistics.median(base_rates)
        if ratio and rates and base_rates
        else None,
        "notes": [f"round {i + 1}: {note}" for i, m in enumerate(mine) for note in m.get("notes", [])],
    }


def result(wall_s: float, survived: bool | None, **fields: Any) -> dict:
    """One run's outcome, as summarize() reads it."""
    return {
        "wall_s": wall_s,
        "survived": survived,
        "examples_per_sec": fields.get("examples_per_sec"),
        "steps_redone": fields.get("steps_redone"),
        "recovery_s": fields.get("recovery_s"),
        "notes": fields.get("notes", []),
    }


# -- specs, drivers and MLflow ----------------------------------------------------------------------


def write_spec(
    folder: Path, name: str, args: argparse.Namespace, cluster: dict, max_steps: int, *extra: str
) -> Path:
    """faults.py's LeNet spec with `cluster` and the overrides `extra`, tracked to `folder`/mlflow.db
    (experiment `name`)."""
    from towerflow.spec.loading import apply_override, validate_spec

    raw = yaml.safe_load(SPEC.read_text())
    for item in (
        f"name={name}",
        f"data.train.paths={DATA}/train-*",
        "data.eval=null",
        "supervision.eval=null",
        "export.saved_model=false",
        "data.epochs=null",
        f"training.max_steps={max_steps}",
        "training.mode=sync",
        f"supervision.checkpoint.every_steps={args.every}",
        "supervision.log_every_steps=1",  # MLflow hears of every step
        f"tracking.tracking_uri={tracking_uri(folder)}",
        f"tracking.experiment={name}",
        *extra,
    ):
        apply_override(raw, item)
    raw["cluster"] = {**raw["cluster"], **cluster}
    if isinstance(cluster["workers"], dict):  # elastic: every running worker's gradient, no backup
        raw["training"].update(replicas_to_aggregate=None, total_num_replicas=None)
    path = folder / f"{name}.yaml"
    validate_spec(raw, source=str(path))
    path.write_text(yaml.safe_dump(raw))
    return path


def clean_run(
    cluster, args, tmp: Path, name: str, config: dict, max_steps: int, *extra: str, node: Any = None
) -> dict:
    client = mlflow_client(tmp)
    spec = write_spec(tmp, name, args, config, max_steps, *extra)
    driver = start_driver(cluster, spec, tmp / "driver.log", node=node)
    try:
        driver.wait()
    finally:
        driver.kill()
    run = poll_store(lambda: latest_run(client, name))
    if run is None:
        return result(driver.wall_s, False, notes=[f"no MLflow run: {driver.text(2000)!r}"])
    ok, _, notes = run_outcome(client, run.info.run_id, driver, max_steps)
    return result(driver.wall_s, ok, examples_per_sec=driver.examples_per_sec(), notes=notes)
