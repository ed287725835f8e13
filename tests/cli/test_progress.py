"""The progress display: its total (the first of max_steps, a hook's last step and the step at which
the data runs out) and its banner."""

from __future__ import annotations

import io
import re

from rich.console import Console

from towerflow.cli.progress import ProgressHook
from towerflow.runtime.hooks import SessionInfo, StepEvent
from towerflow.spec import load_spec


def _untimed(printed: str) -> list[str]:
    """The plain lines, each checked to start with the time (a job's log is read later)."""
    lines = printed.splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line) for line in lines), lines
    return [line[20:] for line in lines]


def _session(data_steps, overrides=()):
    spec = load_spec("pipelines/mnist_sync.yaml", overrides)
    return SessionInfo(spec=spec, num_workers=2, num_shards=2, data_steps=data_steps)


def test_the_total_is_the_first_of_max_steps_and_the_end_of_the_data():
    for max_steps, data_steps, total in (
        (1000, 468, 468),
        (1000, None, 1000),
        (200, 468, 200),
        (None, 468, 468),
    ):
        hook = ProgressHook(max_steps, console=Console(file=io.StringIO()))
        hook.after_create_session(_session(data_steps))
        assert hook.total == total, (max_steps, data_steps)


def test_a_hooks_last_step_bounds_the_total_too():
    session = _session(468)
    session.last_step = 300  # StopAtStepHook.begin sets it before any hook's after_create_session
    hook = ProgressHook(1000, console=Console(file=io.StringIO()))
    hook.after_create_session(session)
    assert hook.total == 300


def test_progress_lines_say_no_rate_until_one_is_known(capsys):
    hook = ProgressHook(10, console=Console(file=io.StringIO()), log_every_s=0.0)
    hook.after_create_session(_session(None))  # not a terminal: plain lines
    for step, rate in ((1, None), (2, 1234.4)):
        hook.after_run(None, StepEvent(step, 0.25, {}, 64, 64 * step, float(step), rate, {}, [0]))
    assert _untimed(capsys.readouterr().err) == [
        "step 1/10 loss 0.2500 examples/sec -",
        "step 2/10 loss 0.2500 examples/sec 1,234",
    ]


def test_the_banner_counts_one_tower_per_gpu():
    out = io.StringIO()
    hook = ProgressHook(10, console=Console(file=out))
    hook.after_create_session(_session(None, ["cluster.gpus_per_worker=2"]))
    assert "(sync, 2 workers x 2 towers, 2 PS)" in out.getvalue()


def test_the_total_follows_a_replanned_end_of_the_data(capsys):
    """A rollback or a resize re-plans the data (a file partly read is read again): the lines'
    total is the new end, not the first plan's."""
    session = _session(468)
    hook = ProgressHook(1000, console=Console(file=io.StringIO()), log_every_s=0.0)
    hook.after_create_session(session)
    hook.after_run(None, StepEvent(400, 0.25, {}, 64, 64, 1.0, 100.0, {}, [0]))
    session.data_steps = 492  # the driver's rollback set it
    hook.after_run(None, StepEvent(470, 0.25, {}, 64, 64, 2.0, 100.0, {}, [0]))
    assert _untimed(capsys.readouterr().err) == [
        "step 400/468 loss 0.2500 examples/sec 100",
        "step 470/492 loss 0.2500 examples/sec 100",
    ]
