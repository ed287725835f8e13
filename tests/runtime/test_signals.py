"""Stop signals, as the driver takes them: noted while a run trains, raised between steps, a second one
at once; the command's last word and exit code name which signal it was (real signals to this process)."""

from __future__ import annotations

import os
import signal

import pytest
from support import unstamped

from towerflow.cli.main import _stopped
from towerflow.runtime.signals import EXIT_CODE, StopRequested, StopSignals, stopped_by_sigterm


@pytest.fixture(autouse=True)
def _sigint_as_a_terminal_leaves_it():
    """pytest started in the background from a non-interactive shell (`cmd &`) inherits SIGINT
    ignored, which StopSignals rightly leaves alone (below): these tests start from a terminal's."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_an_ignored_sigint_stays_ignored():
    """A job started in the background ignores Ctrl-C: the run must not start taking it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        stop.check()  # nothing came
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.parametrize(
    ("signum", "code", "last_word"),
    [
        (signal.SIGTERM, 143, "towerflow: terminated (SIGTERM)"),
        (signal.SIGINT, 130, "towerflow: interrupted"),
    ],
    ids=["SIGTERM", "Ctrl-C"],
)
def test_a_signal_is_noted_then_raised_between_steps_and_named_in_the_exit(signum, code, last_word, capsys):
    before = signal.getsignal(signum)
    with StopSignals() as stop:
        stop.check()  # nothing came yet
        os.kill(os.getpid(), signum)  # noted, not raised where the driver happens to be
        assert stop.name == signal.Signals(signum).name
        with pytest.raises(StopRequested, match=stop.name):
            stop.check()
    assert signal.getsignal(signum) is before  # the handler in place before the run is back
    assert stopped_by_sigterm() == (signum == signal.SIGTERM)
    assert _stopped() == code
    assert unstamped(capsys.readouterr().err) == [last_word]


def test_a_second_signal_interrupts_at_once():
    with StopSignals(), pytest.raises(KeyboardInterrupt, match="SIGINT"):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    with StopSignals(), pytest.raises(KeyboardInterrupt, match="SIGINT"):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert not stopped_by_sigterm()  # the last signal decides the exit: Ctrl-C's
    assert EXIT_CODE == 128 + signal.SIGTERM


def test_sigterm_twice_at_once_is_one_request_and_later_it_interrupts():
    """`ray job stop` signals the train command and the driver it supervises alike, and the command
    forwards its own: the driver gets SIGTERM twice within milliseconds, and must stop gracefully.
    (Ctrl-C twice, however fast, interrupts at once: the test above.)"""
    import time

    from towerflow.runtime.signals import REPEAT_WINDOW_S

    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request again: noted once
        assert stop.name == "SIGTERM"
        time.sleep(REPEAT_WINDOW_S + 0.1)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):  # asked again: at once
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_once_ray_has_started_interrupts_as_ctrl_c_does_not_as_rays_exit():
    """`ray.init` sets a SIGTERM handler that exits with code 15 (SystemExit): a command stopped
    between its runs or as a run starts would end that run FAILED, or not at all. Once towerflow has
    started (or joined) Ray, SIGTERM raises KeyboardInterrupt, named SIGTERM for the exit (143)."""
    import subprocess
    import sys

    script = """
import os, signal
from towerflow.runtime.cluster import ResourceBudget, ensure_ray, keep_embedded_ray_local
from towerflow.runtime.signals import stopped_by_sigterm
keep_embedded_ray_local()
ensure_ray(ResourceBudget(worker_cpus=1, ps_cpus=0, data_cpus=0, gpus=0))
try:
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
except KeyboardInterrupt as exc:
    print("interrupted by", exc, "sigterm:", stopped_by_sigterm())
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "interrupted by SIGTERM sigterm: True" in out.stdout, out.stdout + out.stderr[-3000:]
