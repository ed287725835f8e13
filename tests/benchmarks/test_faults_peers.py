"""What the faults-beside-the-peers benchmark reads from a run's files: the longest stall from the
kill on, the batches trained twice, and the seconds a fault cost against the same round's clean
run. The progress logs are shaped as the runners write them (the Ray Train one from a hand run,
2026-11-29: killed after batch 15, restarted from its checkpoint of batch 10)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from faults_peers import fault_figures, last_line, summarize  # noqa: E402
from peers.plan import Config, Run  # noqa: E402


def _run(
    folder: Path, marks: list[tuple[int, float]], kill: tuple[int, float] | None, system="raytrain", **fields
) -> Run:
    folder.mkdir(parents=True)
    (folder / "progress.log").write_text("".join(f"{step} {wall:.3f}\n" for step, wall in marks))
    if kill is not None:
        step, wall = kill
        (folder / "kill.json").write_text(json.dumps({"wall": wall, "step": step, "target": "worker"}))
    return Run(Config(system, "lenet", 2), fields.pop("round_", 1), folder, **fields)


def test_a_restart_from_a_checkpoint_is_a_long_stall_and_batches_redone(tmp_path):
    marks = [(step, 100 + 0.25 * step) for step in range(1, 16)]  # the kill after batch 15
    marks += [(step, 118 + 0.25 * (step - 11)) for step in range(11, 31)]  # from batch 11 again
    figures = fault_figures(_run(tmp_path / "r", marks, kill=(15, 103.8)))
    assert figures["redone"] == 5
    assert abs(figures["stall_s"] - 14.2) < 1e-6  # the kill -> the restarted run's first batch


def test_training_on_through_a_loss_redoes_nothing_and_stalls_little(tmp_path):
    marks = [(step, 100 + 0.2 * step) for step in range(1, 31)]
    marks[16] = (17, marks[16][1] + 1.5)  # the replacement's join: one slow batch
    marks[17:] = [(step, wall + 1.5) for step, wall in marks[17:]]
    figures = fault_figures(_run(tmp_path / "r", marks, kill=(15, 103.0)))
    assert figures["redone"] == 0
    assert abs(figures["stall_s"] - 1.7) < 1e-6


def test_a_run_without_a_kill_has_no_fault_figures(tmp_path):
    figures = fault_figures(_run(tmp_path / "r", [(1, 100.0)], kill=None))
    assert figures == {"stall_s": None, "redone": None}


def _marks(seconds_a_batch: float, pause_s: float = 0.0) -> list[tuple[int, float]]:
    """30 batches from wall time 100, with a pause after batch 15."""
    return [(step, 100 + seconds_a_batch * step + (pause_s if step > 15 else 0)) for step in range(1, 31)]


def test_seconds_lost_pair_rounds_and_a_failed_run_is_named_by_its_error(tmp_path):
    """Seconds lost are training time (first batch to last), not wall time: the start-up (wall_s
    here 60-90 s) swings more than a fault costs."""
    kill = (15, 103.01)
    clean = [
        _run(tmp_path / f"c{r}", _marks(0.2), None, round_=r, wall_s=w) for r, w in ((1, 60.0), (2, 90.0))
    ]
    faulted = [
        _run(tmp_path / f"f{r}", _marks(0.2, pause), kill, round_=r, wall_s=w)
        for r, pause, w in ((1, 15.0, 75.0), (2, 20.0, 70.0))
    ]
    marks = _marks(0.2)
    failed = _run(tmp_path / "ps", marks[:15], kill, system="psstrategy", error="exit 1: ...")
    (tmp_path / "ps.log").write_text(
        "Traceback (most recent call last):\n  File ...\n"
        "tensorflow.python.framework.errors_impl.UnavailableError: Graph execution error:\n"
        "Additional GRPC error information ...\n"
    )
    rows = summarize(
        {"raytrain/clean": clean, "raytrain/worker": faulted, "psstrategy/ps": [failed]}, tmp_path
    )
    by_case = {(r["system"], r["fault"]): r for r in rows}
    assert [round(lost, 6) for lost in by_case["raytrain", "worker"]["lost_s"]] == [15.0, 20.0]
    assert by_case["raytrain", "worker"]["survived"] == "2/2"
    failure = by_case["psstrategy", "ps"]
    assert failure["survived"] == "0/1" and "UnavailableError" in failure["errors"][0]
    assert last_line(rows) == "peer_faults_lost_s=raytrain/worker:17.5,psstrategy/ps:failed"


def test_a_run_restarted_by_hand_counts_its_seconds_lost_but_not_as_survived(tmp_path):
    """ParameterServerStrategy's run fails on a lost PS and is started again, resuming from its
    checkpoint: both processes log to one progress.log, so its loss counts the restart."""
    clean = _run(tmp_path / "c", _marks(0.2), None, system="psstrategy", wall_s=15.0)
    marks = _marks(0.2)[:15] + [(step, wall + 12.0) for step, wall in _marks(0.2)[10:]]  # from batch 11
    again = _run(tmp_path / "f", marks, (15, 103.01), system="psstrategy", wall_s=40.0)
    again.report["restarted_after"] = "UnavailableError: Graph execution error:"
    (row,) = summarize({"psstrategy/clean": [clean], "psstrategy/ps": [again]}, tmp_path)
    assert row["survived"] == "0/1" and row["restarted"] == ["UnavailableError: Graph execution error:"]
    # every batch from 11 on came 12 s later than the clean run's
    assert row["redone"] == [5] and round(row["lost_s"][0], 6) == 12.0
    assert last_line([row]) == "peer_faults_lost_s=psstrategy/ps:12.0(restarted)"
