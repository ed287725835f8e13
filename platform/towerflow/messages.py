"""How towerflow's messages show: `towerflow: ` and the message, a warning or an error named so,
after the time where they are read later (a job's log, a pod's, a file) instead of on a terminal.

Library modules only log (`logging.getLogger(__name__)`, under the `towerflow` logger); what shows
the lines is the caller's choice. The CLI always shows them on stderr (`show`); `towerflow.train`
shows them only where its caller has set up no logging of its own (`show_unless_configured`), as a
script or a notebook usually has not: otherwise a lost worker's replacement, a resumed run's data
position or a bad record skipped would go unseen there, Python showing only warnings, bare.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

LOGGER = "towerflow"
PREFIX = "towerflow: "
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # local time, as Ray's own lines in the same log have it
_LEVEL_WORDS = ((logging.ERROR, "error: "), (logging.WARNING, "warning: "))


def stamp(when: float | None = None) -> str:
    """The time a line of a log read later starts with (`when`: seconds since the epoch, or now)."""
    return time.strftime(TIME_FORMAT, time.localtime(when))


def read_later(stream: TextIO) -> bool:
    """Whether lines written to `stream` are read after the fact (not a terminal), and so want times."""
    isatty = getattr(stream, "isatty", None)
    return not (isatty is not None and isatty())


def say(text: str, *, stream: TextIO | None = None) -> None:
    """A command's own line (`towerflow: ...`, not a log record) on `stream` (default: stdout as it
    is now), timed where it is read later as the log's lines are: a job's log then tells when its
    run was named, ended or failed. Flushed: a job's follower reads it at once."""
    stream = sys.stdout if stream is None else stream
    stream.write(_each_line(f"{stamp()} " if read_later(stream) else "", text) + "\n")
    stream.flush()


def _each_line(lead: str, text: str) -> str:
    """`text` with `lead` before each of its lines."""
    return "\n".join(f"{lead}{line}" for line in text.splitlines() or [""])


class MessageFormatter(logging.Formatter):
    """`[time ]towerflow: [warning: |error: ]message`, each line of a multi-line message prefixed
    alike (a traceback logged with it stays as Python prints it)."""

    def __init__(self, *, timestamps: bool = False) -> None:
        super().__init__()
        self.timestamps = timestamps

    def format(self, record: logging.LogRecord) -> str:
        word = next((w for level, w in _LEVEL_WORDS if record.levelno >= level), "")
        lead = f"{stamp(record.created)} {PREFIX}{word}" if self.timestamps else f"{PREFIX}{word}"
        text = _each_line(lead, record.getMessage())
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        return text


class _CurrentStderr(logging.StreamHandler):
    """Writes to `sys.stderr` as it is at each line, not as it was when made: a live progress bar
    (rich's) swaps it for a proxy that prints the line above the bar instead of through it."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # StreamHandler's own __init__ sets it


def _root_unconfigured(record: logging.LogRecord) -> bool:
    return not logging.getLogger().handlers


def show(stream: TextIO | None = None, *, propagate: bool = False) -> None:
    """Show towerflow's messages (INFO and above) on `stream` (default: stderr, whatever it is at
    each line), timed where it is no terminal; once per process, later calls keep the first
    handler. `propagate`: pass them on to the root logger's handlers instead, once it has any."""
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        handler = _CurrentStderr() if stream is None else logging.StreamHandler(stream)
        handler.setFormatter(MessageFormatter(timestamps=read_later(handler.stream)))
        if propagate:  # a caller that sets logging up later (basicConfig) gets each line once, its way
            handler.addFilter(_root_unconfigured)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = propagate


def show_unless_configured() -> None:
    """`show` where nothing shows towerflow's messages yet: neither a handler of its own nor the
    root logger's (a caller's `logging.basicConfig`, pytest's capture), which then keep them; and
    only until the root logger has a handler."""
    if not logging.getLogger(LOGGER).handlers and not logging.getLogger().handlers:
        show(propagate=True)
