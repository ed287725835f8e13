"""`training.failure.driver_restarts`: `towerflow train` as a small supervisor of its own driver.

The command starts the driver (the same command, marked as the child) as a child process, and where a
signal kills it (the kernel's OOM killer, a SIGKILL, a crash) starts it again, resuming the same
run: on a Ray cluster the new driver takes the lost one's live shards and workers over
(runtime/run_keeper.py), or goes on from the run's checkpoint, or, where it has neither (the driver
was killed as the run started), starts the same run over from step 0; so a driver lost in a Ray job or a KubeRay RayJob costs seconds, not the
job (whose retry starts a new cluster from the stored checkpoint). A driver that exits (finished,
failed on bad input, stopped) is not started again, and neither is one after the command itself
was told to stop.

The child runs in a process group of its own, and a stop signal for the command (Ctrl-C at a
terminal, `kill`) is forwarded to it from here. `ray job stop` signals the entrypoint and its
children alike, so the child gets that SIGTERM twice: its stop signals take SIGTERM repeated
within half a second as the same request (runtime/signals.py). The child dies with this process (Linux: its
parent-death signal), as the command's driver did when the command was the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)
# Set in the child's environment: the file it writes its MLflow run id into (and the mark that it
# is the child: it runs the driver itself).
RUN_ID_FILE_ENV = "TOWERFLOW_DRIVER_RUN_ID_FILE"
# Set in a restarted child's environment: the restart's number (a run it cannot resume it starts over).
RESTART_ENV = "TOWERFLOW_DRIVER_RESTART"
_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
ON_A_CLUSTER = 2  # `driver_restarts: auto` where the command joins a Ray cluster


def restarts_wanted(setting: int | str) -> int:
    """`training.failure.driver_restarts` as a number: auto is `ON_A_CLUSTER` where the command
    joins a Ray cluster (RAY_ADDRESS), 0 on the embedded Ray, which a killed driver takes along (its
    shards with it: nothing to take over, and a restart would start a Ray of its own)."""
    from towerflow.runtime.cluster import runs_on_embedded_ray

    if setting == "auto":
        return 0 if runs_on_embedded_ray() else ON_A_CLUSTER
    return int(setting)


def is_supervised_child() -> bool:
    """Whether this process is a supervised driver (it must not supervise again)."""
    return RUN_ID_FILE_ENV in os.environ


def is_restarted_driver() -> bool:
    """Whether this process is a driver its command started again (not the first one)."""
    return RESTART_ENV in os.environ


def note_run_id(run_id: str) -> None:
    """Tell the supervisor, if there is one, which MLflow run this driver runs (a restart resumes it)."""
    path = os.environ.get(RUN_ID_FILE_ENV)
    if path:
        Path(path).write_text(run_id)


def supervise_driver(command: Callable[[str | None], list[str]], restarts: int, resume: str | None) -> int:
    """Run `command(resume)` (argv of the driver, resuming run `resume`, or None: as given) as a
    child, starting it again up to `restarts` times where a signal killed it; returns the exit code
    of the last one (128 + the signal's number, as a shell says it, where one killed it)."""
    with tempfile.TemporaryDirectory(prefix="towerflow-driver-") as scratch, _forwarding_signals() as stop:
        run_id_file = Path(scratch) / "run_id"
        env = {**os.environ, RUN_ID_FILE_ENV: str(run_id_file)}
        code = 0
        for restart in range(restarts + 1):
            if restart:
                resume = run_id_file.read_text() if run_id_file.exists() else resume
                log.warning(
                    "the driver (pid %d) was killed (%s); starting it again%s (restart %d of %d)",
                    stop.child.pid,
                    signal.Signals(-code).name,
                    f" to resume run {resume}" if resume and resume != "auto" else "",
                    restart,
                    restarts,
                )
            stop.child = subprocess.Popen(
                command(resume),
                env={**env, RESTART_ENV: str(restart)} if restart else env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            if stop.received is not None:  # it came while the child was being started
                stop.child.send_signal(stop.received)
            code = stop.child.wait()
            if code >= 0 or stop.received is not None:
                break
        else:
            log.error(
                "the driver was killed again (%s), after %d restart(s)", signal.Signals(-code).name, restarts
            )
        return code if code >= 0 else 128 - code


class _Stop:
    """The child to forward a stop signal to, and the first one received."""

    child: subprocess.Popen | None = None
    received: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)


@contextlib.contextmanager
def _forwarding_signals() -> Iterator[_Stop]:
    stop = _Stop()
    previous = {signum: signal.signal(signum, stop) for signum in _FORWARDED}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _die_with_parent() -> None:
    """In the child, before it runs: SIGKILL it when this process dies (Linux only; elsewhere the
    child outlives a killed supervisor)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
