"""Running benchmarks/faults_cluster.py's cases: the local clusters they need (a plain 3-node one;
for the head's loss one whose GCS keeps its tables in a Redis), rounds with the cases rotated, a case
that breaks down counted as not survived, and the table rows against each case's clean run."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import ensure_mnist
from faults_cluster import BASELINE, GCS_FT_ROWS, RUNS, Log
from faults_cluster_rows import DATA, result, summarize
from faults_driver import ROOT


def selected_runs(only: list[str] | None) -> list[tuple[Callable[..., dict[str, dict]], tuple[str, ...]]]:
    """The runs whose rows match one of `only` (substrings of a row's name), with their clean runs."""
    wanted = {row for row in BASELINE if not only or any(o in row for o in only)}
    wanted |= {BASELINE[row] for row in wanted}
    return [(run, rows) for run, rows in RUNS if wanted & set(rows)]


def guarded(run: Callable[..., dict[str, dict]], rows: tuple[str, ...], cluster, args, log: Log) -> dict:
    """The run's results; a case that broke down counts as not survived, with the reason in its notes."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="faults-cluster-") as tmp:
        try:
            return run(cluster, args, Path(tmp), log)
        except Exception as exc:  # a fault not survived is a result, not a crash of the benchmark
            log(f"  {rows[0]}: {type(exc).__name__}: {exc}")
            note = f"{type(exc).__name__}: {exc}"[:3000]
            return {row: result(time.monotonic() - started, False, notes=[note]) for row in rows}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_cluster_cases(args: argparse.Namespace, log: Log) -> list[dict]:
    """Start a 3-node LocalCluster (and, for the head's loss, one whose GCS keeps its tables in a
    Redis), run `args.rounds` rounds of the cluster cases (each with its clean run), stop the
    clusters, and return the faulted cases' table rows."""
    runs = selected_runs(args.only)
    if not runs:
        return []
    sys.path.insert(0, str(ROOT / "tests"))  # tests/multinode.py: the multi-node cluster of the tests
    from multinode import LocalCluster
    from redis_store import RedisStore

    ensure_mnist(DATA, log)
    results: dict[str, list[dict]] = {}
    plain = [(run, rows) for run, rows in runs if not GCS_FT_ROWS & set(rows)]
    with_redis = [(run, rows) for run, rows in runs if GCS_FT_ROWS & set(rows)]
    on_term = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # stop the nodes on a SIGTERM too
    try:
        if plain:
            with LocalCluster(head_cpus=2, node_cpus=(2, 2)) as cluster:
                _rounds(plain, cluster, args, log, results)
        if with_redis:
            with (
                RedisStore() as redis,
                LocalCluster(head_cpus=0, node_cpus=(2, 2), gcs_store=redis) as cluster,
            ):
                _rounds(with_redis, cluster, args, log, results)
    finally:
        signal.signal(signal.SIGTERM, on_term)
    return [
        summarize(row, results[row], results[BASELINE[row]], ratio=not row.startswith("driver killed"))
        for row in BASELINE
        if row in results
    ]


def _rounds(runs: list, cluster, args: argparse.Namespace, log: Log, results: dict[str, list[dict]]) -> None:
    for round_ in range(args.rounds):
        for run, rows in runs[round_ % len(runs) :] + runs[: round_ % len(runs)]:
            log(f"round {round_ + 1} (cluster): {', '.join(rows)}")
            for row, outcome in guarded(run, rows, cluster, args, log).items():
                results.setdefault(row, []).append(outcome)
                log(f"  {row}: {outcome}")
