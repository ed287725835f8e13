"""How towerflow's log lines show: the CLI's form, and a script's default (towerflow/messages.py)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from towerflow.messages import MessageFormatter, read_later, say, stamp

TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def _record(level: int, message: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("towerflow.x", level, __file__, 1, message, args, exc_info)


@pytest.mark.parametrize(
    ("level", "line"),
    [
        (logging.INFO, "towerflow: worker 1 replaced"),
        (logging.WARNING, "towerflow: warning: worker 1 replaced"),
        (logging.ERROR, "towerflow: error: worker 1 replaced"),
    ],
)
def test_a_message_says_its_level_after_the_prefix(level, line):
    assert MessageFormatter().format(_record(level, "worker %d replaced", 1)) == line


def test_each_line_of_a_message_is_prefixed_and_a_traceback_follows_as_python_prints_it():
    try:
        raise ValueError("bad value")
    except ValueError:
        record = _record(logging.WARNING, "inferred:\n  a: float32", exc_info=sys.exc_info())
    lines = MessageFormatter().format(record).splitlines()
    assert lines[:3] == [
        "towerflow: warning: inferred:",
        "towerflow: warning:   a: float32",
        "Traceback (most recent call last):",
    ]
    assert lines[-1] == "ValueError: bad value"


def test_lines_read_later_start_with_the_time_the_message_was_logged():
    record = _record(logging.WARNING, "worker %d lost\nreplaced", 1)
    record.created = time.mktime((2026, 12, 7, 8, 30, 5, 0, 0, -1))
    assert MessageFormatter(timestamps=True).format(record).splitlines() == [
        "2026-12-07 08:30:05 towerflow: warning: worker 1 lost",
        "2026-12-07 08:30:05 towerflow: warning: replaced",
    ]
    assert re.fullmatch(TIME, stamp())


def test_only_a_terminal_is_read_as_it_comes():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        assert not read_later(terminal)
    os.close(leader)
    assert read_later(io.StringIO())


SCRIPT = """
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, format="app %(levelname)s %(message)s")
from towerflow.messages import show_unless_configured
show_unless_configured()
show_unless_configured()  # a second run in the same process adds no second handler
logging.getLogger("towerflow.launch").info("data resumes in epoch 2")
logging.getLogger("towerflow.tracking").warning("a store lost with the job")
if sys.argv[1] == "late":  # a notebook that sets its logging up after its first run
    logging.basicConfig(level=logging.INFO, format="app %(levelname)s %(message)s")
    logging.getLogger("towerflow.launch").info("the second run")
"""


@pytest.mark.parametrize(
    ("caller", "shown"),
    [  # stderr is a pipe here, read later: the script's lines are timed
        (
            "bare",
            [
                f"{TIME} towerflow: data resumes in epoch 2",
                f"{TIME} towerflow: warning: a store lost with the job",
            ],
        ),
        ("configured", ["app INFO data resumes in epoch 2", "app WARNING a store lost with the job"]),
        (
            "late",
            [
                f"{TIME} towerflow: data resumes in epoch 2",
                f"{TIME} towerflow: warning: a store lost with the job",
                "app INFO the second run",  # once, in the caller's format: towerflow's handler gave way
            ],
        ),
    ],
)
def test_a_script_sees_the_messages_once_in_its_own_logging_where_it_has_some(caller, shown):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, caller], capture_output=True, text=True, timeout=60, check=True
    )
    lines = out.stderr.splitlines()
    assert len(lines) == len(shown) and all(re.fullmatch(p, line) for p, line in zip(shown, lines)), lines


LIVE_BAR = """
import io, logging, sys
from towerflow.messages import show
show()
real, sys.stderr = sys.stderr, io.StringIO()  # as a live progress bar swaps in its proxy
logging.getLogger("towerflow.runtime").warning("worker 1 lost")
caught, sys.stderr = sys.stderr.getvalue(), real
print(caught, end="")
"""


def test_a_message_goes_where_stderr_is_at_the_time_so_a_live_bar_prints_it_above_itself():
    out = subprocess.run(
        [sys.executable, "-c", LIVE_BAR], capture_output=True, text=True, timeout=60, check=True
    )
    assert re.fullmatch(f"{TIME} towerflow: warning: worker 1 lost\n", out.stdout), out
    assert out.stderr == ""


def test_a_commands_own_line_is_timed_where_it_is_read_later():
    """`say`: a job's log tells when its run was named or ended, as its log records do; a terminal
    shows the line bare."""
    later = io.StringIO()
    say("towerflow: run abc finished\nsecond line", stream=later)
    assert re.fullmatch(rf"{TIME} towerflow: run abc finished\n{TIME} second line\n", later.getvalue())

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    say("towerflow: run abc finished", stream=terminal)
    assert terminal.getvalue() == "towerflow: run abc finished\n"
