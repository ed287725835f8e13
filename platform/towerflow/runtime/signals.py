"""SIGTERM stops a run as Ctrl-C does.

`ray job stop`, Kubernetes and `kill` stop a driver with SIGTERM. `ray.init` installs a handler
that exits at once, and Ray's C++ side prints a stack dump first; the run then ended FAILED with
the error "1". After towerflow starts or connects to Ray, SIGTERM raises KeyboardInterrupt in the
main thread instead: the run ends KILLED, its hooks end (the tracker closes the MLflow run,
checkpoints already written stay), the actors are released, and the command exits 143.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
_received = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True
    # The first SIGTERM asks for a clean stop; a second one ends the process at once, clean-up or not.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt("SIGTERM")


def stop_on_sigterm() -> None:
    """Make SIGTERM interrupt the main thread (Python delivers signals there only)."""
    global _received
    if threading.current_thread() is threading.main_thread():
        _received = False
        signal.signal(signal.SIGTERM, _interrupt)


def received_sigterm() -> bool:
    """Whether an interrupt came from SIGTERM. Ray re-raises an interrupt that reaches it inside a
    wait as a new, plain KeyboardInterrupt, so the exception itself cannot tell."""
    return _received
