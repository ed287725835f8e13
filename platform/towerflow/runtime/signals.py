"""SIGTERM and Ctrl-C stop a run at the next step, not in the middle of whatever the driver does.

`ray job stop`, Kubernetes and `kill` stop a driver with SIGTERM; a user at a terminal presses
Ctrl-C. Raised at once, the interrupt can land inside an MLflow write and leave the SQLite store
locked, so that the run could not even be marked as ended; Ray's own SIGTERM handler also exited
after a C++ stack dump and left the run FAILED. While a run trains, `StopSignals` only notes the
signal. The driver lets the steps in flight end, then raises `StopRequested` (a KeyboardInterrupt):
the run ends KILLED, its hooks end (the checkpoint hook saves the final state, as TensorFlow's
PreemptionCheckpointHandler does; the tracker closes the MLflow run), the actors are released.
A second signal interrupts at once, wherever the driver is; but SIGTERM again within half a second
is the same request delivered twice (`ray job stop` signals the train command and the driver it
supervises alike, and the command forwards its own: cli/driver_restarts.py). Ctrl-C pressed twice,
however fast, stops at once.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
REPEAT_WINDOW_S = 0.5  # SIGTERM again this soon is the same stop, delivered twice
_last: int | None = None  # the signal that stopped the last run in this process


class StopRequested(KeyboardInterrupt):
    """A stop signal taken between steps: the shards hold a consistent state, which may be saved."""


class StopSignals:
    """A context in which SIGTERM and SIGINT are noted for `check()` (main thread only; a signal
    that the process ignores stays ignored, as SIGINT does for a job started in the background)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._received_at = 0.0  # monotonic
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        global _last
        _last = None
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous = signal.getsignal(signum)  # None: set outside Python, so not restorable
                if previous is not None and previous is not signal.SIG_IGN:
                    self._previous[signum] = previous
                    signal.signal(signum, self._note)
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        global _last
        _last = signum
        now = time.monotonic()
        if self.received is not None:
            if signum == self.received == signal.SIGTERM and now - self._received_at < REPEAT_WINDOW_S:
                return  # the same stop, delivered twice
            raise KeyboardInterrupt(signal.Signals(signum).name)  # asked twice: stop now, wherever it is
        self.received, self._received_at = signum, now

    @property
    def name(self) -> str | None:
        """The signal that came, as 'SIGTERM' or 'SIGINT'; None while none did."""
        return signal.Signals(self.received).name if self.received is not None else None

    def check(self) -> None:
        """Raise StopRequested if a stop signal came: call where an interrupt is safe."""
        if self.received is not None:
            raise StopRequested(self.name)


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM interrupts as Ctrl-C does (KeyboardInterrupt, named SIGTERM for the
    exit), outside a run's `StopSignals` too: a command stopped between its runs (`towerflow
    compare`'s modes) or as its run starts ends that run KILLED with exit 143, not as Ray's own
    handler, set by `ray.init`, left it (SystemExit 15: a run FAILED, or never ended). Main thread
    only, as Python's signal handlers."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def take_sigterm_back_from_ray() -> None:
    """After `ray.init`: `interrupt_on_sigterm` where Ray's handler replaced whatever was there."""
    handler = signal.getsignal(signal.SIGTERM)
    if getattr(handler, "__module__", "").startswith("ray."):
        interrupt_on_sigterm()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _last
    _last = signum
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stopped_by_sigterm() -> bool:
    """Whether the last run in this process was stopped by SIGTERM (else by Ctrl-C, or not at all).
    The exception cannot always tell: a second signal interrupts wherever the driver is, and Ray
    re-raises an interrupt inside its waits as a new, plain KeyboardInterrupt."""
    return _last == signal.SIGTERM
