"""How towerflow's messages show: `towerflow: ` and the message, a warning or an error named so.

Library modules only log (`logging.getLogger(__name__)`, under the `towerflow` logger); what shows
the lines is the caller's choice. The CLI always shows them on stderr (`show`); `towerflow.train`
shows them only where its caller has set up no logging of its own (`show_unless_configured`), as a
script or a notebook usually has not: otherwise a lost worker's replacement, a resumed run's data
position or a bad record skipped would go unseen there, Python showing only warnings, bare.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

LOGGER = "towerflow"
PREFIX = "towerflow: "
_LEVEL_WORDS = ((logging.ERROR, "error: "), (logging.WARNING, "warning: "))


class MessageFormatter(logging.Formatter):
    """`towerflow: [warning: |error: ]message`, each line of a multi-line message prefixed alike
    (a traceback logged with it stays as Python prints it)."""

    def format(self, record: logging.LogRecord) -> str:
        word = next((w for level, w in _LEVEL_WORDS if record.levelno >= level), "")
        lines = record.getMessage().splitlines() or [""]
        text = "\n".join(f"{PREFIX}{word}{line}" for line in lines)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        return text


def show(stream: TextIO | None = None, *, propagate: bool = False) -> None:
    """Show towerflow's messages (INFO and above) on `stream` (stderr); once per process, later
    calls keep the first handler. `propagate`: pass them on to the root logger's handlers too."""
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(MessageFormatter())
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = propagate


def show_unless_configured() -> None:
    """`show` where nothing shows towerflow's messages yet: neither a handler of its own nor the
    root logger's (a caller's `logging.basicConfig`, pytest's capture), which then keep them."""
    if not logging.getLogger(LOGGER).handlers and not logging.getLogger().handlers:
        show(propagate=True)
