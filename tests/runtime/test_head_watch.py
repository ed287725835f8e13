"""The driver's answers from the GCS, asked off its loop, and the head's silence told once each way
(runtime/head_watch.py). A real head lost and started again: tests/runtime/test_multinode_driver_loss.py."""

from __future__ import annotations

import threading
import time

from towerflow.runtime.head_watch import BackgroundAnswer, HeadState, HeadWatch


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_read_never_waits_for_an_answer_that_hangs_and_the_last_answer_stays():
    answering = threading.Event()
    answering.set()
    calls = []

    def ask() -> int:
        answering.wait()  # as a GCS call waits while the head is down
        calls.append(1)
        return len(calls)

    answers = BackgroundAnswer(ask, every_s=0.01, name="test-answers")
    try:
        _wait_for(lambda: (answers() or 0) >= 2)
        answering.clear()  # the head goes
        time.sleep(0.1)
        started = time.monotonic()
        held = answers()
        assert time.monotonic() - started < 0.5  # the read did not wait (the ask waits until set)
        assert held is not None and answers.silent_s() >= 0.05
        assert not answers.answered_after(started)  # what waits for the GCS waits on
        answering.set()  # the head is back
        _wait_for(lambda: answers() > held)
        assert answers.silent_s() < 1.0 and answers.answered_after(started)
    finally:
        answers.close()
        answering.set()


def test_nothing_is_answered_before_the_first_answer_and_a_failing_look_keeps_the_last():
    first = threading.Event()
    calls = []

    def ask() -> dict[str, int]:
        calls.append(1)
        if len(calls) == 1:
            first.wait()
            return {"n1": 0}
        raise RuntimeError("GCS unavailable")

    answers = BackgroundAnswer(ask, every_s=0.01, name="test-answers")
    try:
        assert answers() is None  # the first look waits
        assert not answers.answered_after(float("-inf"))
        first.set()
        _wait_for(lambda: answers() is not None)
        answered = time.monotonic()
        _wait_for(lambda: len(calls) >= 5)  # then every look fails
        assert answers() == {"n1": 0}
        assert answers.silent_s() >= 0.03
        assert not answers.answered_after(answered)  # a failed look is no answer
    finally:
        answers.close()
        first.set()


class _Silence:
    """A BackgroundAnswer's silence, set by the test: `seconds` the current one, `ended` the
    longest that an answer ended since the watch last looked."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.ended = 0.0

    def silent_s(self) -> float:
        return self.seconds

    def take_longest_silence(self) -> float:
        ended, self.ended = self.ended, 0.0
        return ended


def test_the_head_watch_tells_once_when_the_head_falls_silent_and_once_when_it_answers_again():
    silence = _Silence()
    watch = HeadWatch(silence, silent_after_s=5.0)
    silence.seconds = 0.4
    assert watch.look(step=100) is None
    silence.seconds = 4.9
    assert watch.look(step=101) is None  # a busy head, not yet a silent one
    silence.seconds = 5.2
    went = watch.look(step=130)
    # since the last step seen with a fresh answer (at 101 the head was already silent 4.9 s)
    assert went is not None and not went.over and went.from_step == 100
    assert "has not answered for 5 s, since step 100" in went.describe()
    assert watch.state is HeadState.SILENT
    silence.seconds = 9.0
    assert watch.look(step=400) is None  # told once
    silence.seconds = 14.5
    assert watch.look(step=600) is None
    silence.seconds = 0.3
    back = watch.look(step=650)
    assert back is not None and back.over and back.from_step == 100 and back.seconds == 14.5
    assert "did not answer for 14 s, from step 100" in back.describe()
    assert back.outcome() == "training went on, 500 step(s) meanwhile"  # to 600, the last look while silent
    assert watch.state is HeadState.ANSWERING and watch.look(step=651) is None


def test_a_silence_that_began_and_ended_between_two_looks_is_told_once_as_over():
    """The driver's loop held up in a call through the head's whole absence (its turn longer
    than the silence): the answers' own record still tells it."""
    silence = _Silence()
    watch = HeadWatch(silence, silent_after_s=5.0)
    silence.seconds = 0.4
    assert watch.look(step=100) is None
    silence.seconds, silence.ended = 0.2, 8.5  # the head went and came back since the last look
    missed = watch.look(step=180)
    assert missed is not None and missed.over and missed.from_step == 100 and missed.seconds == 8.5
    assert missed.outcome() == "the run went on once it answered"  # its steps meanwhile unknown
    assert watch.state is HeadState.ANSWERING and watch.look(step=181) is None  # told once
    silence.ended = 1.0  # an answer a second after the one before: no silence
    assert watch.look(step=182) is None


def test_the_answers_record_the_longest_silence_an_answer_ended():
    answering = threading.Event()
    answering.set()
    answers = BackgroundAnswer(lambda: answering.wait() and 1, every_s=0.01, name="test-answers")
    try:
        _wait_for(lambda: answers() is not None)
        answers.take_longest_silence()
        answering.clear()  # the head goes
        time.sleep(0.3)
        assert answers.take_longest_silence() < 0.1  # not ended yet
        answering.set()  # and comes back
        _wait_for(lambda: answers.silent_s() < 0.05)
        assert 0.3 <= answers.take_longest_silence() < 1.0
        assert answers.take_longest_silence() < 0.1  # taken
    finally:
        answers.close()
        answering.set()


def test_a_silence_through_which_no_step_was_heard_says_so():
    """A parameter server lost with the head: the workers wait for its replacement, which waits
    for the GCS. (After a rollback the steps heard go back: still none trained meanwhile.)"""
    silence = _Silence()
    watch = HeadWatch(silence, silent_after_s=5.0)
    assert watch.look(step=134) is None
    silence.seconds = 6.0
    assert watch.look(step=134) is not None
    silence.seconds = 12.0
    assert watch.look(step=134) is None
    silence.seconds = 0.2
    back = watch.look(step=100)
    assert back is not None and back.over
    assert back.outcome() == "the run went on, no step trained meanwhile"
