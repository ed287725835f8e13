"""The peers benchmark's report says why each missed target was missed, from the run's own figures:
a CPU bound below the goal, idle cores, or the rounds' spread. Figures are those of the run of
record (docs/benchmarks.md, 2026-11-26 02:26 UTC, 2 cores), two rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from peers.plan import Config, Run  # noqa: E402
from peers.report import TARGETS, collect, missed_targets, why_missed  # noqa: E402


def _runs(
    system: str, workload: str, rates: list[float], cpu_ms: dict[str, float] | None = None
) -> list[Run]:
    config = Config(system, workload, 1 if system == "keras" else 2, every_round=True)
    cpu = {role: ms / 1000 for role, ms in (cpu_ms or {}).items()}
    return [
        Run(config, round_, Path("unused"), report={"rate": rate, "cpu_per_batch": cpu})
        for round_, rate in enumerate(rates, start=1)
    ]


@pytest.fixture
def figures():
    runs = [
        *_runs("keras", "lenet", [2152, 2219]),
        *_runs("towerflow_sync", "lenet", [1737, 1533], {"workers": 235.8, "shards": 21.1, "other": 20.0}),
        *_runs("towerflow_async", "lenet", [1707, 1670], {"workers": 242.3, "shards": 24.5, "other": 20.9}),
        *_runs("psstrategy", "lenet", [1582, 1486]),
        *_runs("raytrain", "lenet", [846, 747]),
        *_runs("towerflow_sync", "mlp", [3156, 3221], {"workers": 16.8, "shards": 8.9, "other": 6.7}),
        *_runs("towerflow_async", "mlp", [3326, 3000], {"workers": 17.0, "shards": 9.2, "other": 8.2}),
    ]
    return collect(runs)


def _target(name: str):
    return next(t for t in TARGETS if t.name == name)


def test_a_target_beyond_the_cpu_bound_is_said_out_of_reach_with_the_bound(figures):
    why = why_missed(figures, _target("sync_vs_keras"), cores=2)
    # 2 cores x 256 examples / 276.9 ms of CPU = 1,849 examples/s at most: 0.846x Keras's 2,185.5.
    assert why.startswith("out of reach on 2 cores") and "0.846x Keras model.fit" in why, why
    assert "276.9 ms of CPU per global batch" in why and "workers 235.8" in why, why
    assert "88% busy" in why, why
    psstrategy = why_missed(figures, _target("vs_psstrategy"), cores=2)
    assert psstrategy.startswith("out of reach") and "1.160x TF ParameterServerStrategy" in psstrategy


def test_a_target_within_the_cpu_bound_is_put_down_to_waiting_and_the_rounds_spread(figures):
    why = why_missed(figures, _target("async_vs_sync_mlp"), cores=2)
    assert why.startswith("within the CPU's reach") and "the rest went to waiting" in why, why
    assert "ratios ran 0.93-1.05: the goal lies within their spread" in why, why


def test_on_more_cores_the_same_cpu_leaves_the_target_within_reach(figures):
    assert why_missed(figures, _target("sync_vs_keras"), cores=4).startswith("within the CPU's reach")


def test_met_targets_have_no_line_and_missed_ones_say_by_how_much(figures):
    assert why_missed(figures, _target("vs_raytrain"), cores=2) is None
    lines = missed_targets(figures, cores=2).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "- **towerflow async / TF PSStrategy, 2 workers, LeNet",
        "- **towerflow async / sync, 2 workers, MLP",
        "- **towerflow sync, 2 workers / Keras, LeNet",
    ]
    assert "0.748 against 0.85** (-12%)" in lines[2]
