"""The cluster's head gone silent, and a driver that trains on through it.

With GCS fault tolerance (the GCS's tables in an external Redis: KubeRay's
`gcsFaultToleranceOptions`), a lost head is started again and finds the cluster as it was; the
other nodes, their actors and a driver on one of them live on. Meanwhile a Ray call that needs the
GCS (which nodes drain, which live) waits for it, up to `RAY_gcs_rpc_server_reconnect_timeout_s`,
while the shards, the workers and the data pipeline go on: actors call each other directly. So the
driver never asks the GCS on its loop: `BackgroundAnswer` asks from a thread of its own and the loop
reads the latest answer, and `HeadWatch` tells when the answers stop and when they come back.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
# A look at the GCS answers in under a millisecond: this long without one is a head gone, not a
# busy one (the GCS's own health checks of a raylet give up after 5 missed seconds).
SILENT_AFTER_S = 5.0
# Answers this fresh (a look every second, each under a millisecond) say the head was there.
FRESH_S = 2.0


class BackgroundAnswer(Generic[T]):
    """`ask()`'s latest answer, asked every `every_s` in a daemon thread that the first read starts.
    A read never waits: before the first answer it is None, and while `ask` waits or fails, the last
    one stays (`silent_s` says for how long)."""

    def __init__(
        self, ask: Callable[[], T], every_s: float, name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ask, self._every_s, self._name, self._clock = ask, every_s, name, clock
        self._latest: T | None = None
        self._answered_at = clock()  # the first read's time until the first answer (silent_s)
        self._last_answer_at: float | None = None
        self._longest_ended_s = 0.0  # the longest silence an answer ended, since it was last taken
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self) -> T | None:
        self._start()
        with self._lock:
            return self._latest

    def silent_s(self) -> float:
        """Seconds since the last answer (since the first read, before the first answer)."""
        self._start()
        with self._lock:
            return self._clock() - self._answered_at

    def take_longest_silence(self) -> float:
        """The longest silence (seconds between two answers, or from the first read to the first
        answer) that an answer ended since the last call; 0 where none did."""
        self._start()
        with self._lock:
            longest, self._longest_ended_s = self._longest_ended_s, 0.0
            return longest

    def answered_after(self, moment: float) -> bool:
        """Whether an answer came after `moment` (this clock's): the GCS was there since."""
        self._start()
        with self._lock:
            return self._last_answer_at is not None and self._last_answer_at > moment

    def _start(self) -> None:
        if self._thread is None and not self._closed.is_set():
            with self._lock:
                self._answered_at = self._clock()
            self._thread = threading.Thread(target=self._keep_asking, name=self._name, daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Ask no more (a call waiting on the GCS ends the thread when it returns)."""
        self._closed.set()

    def _keep_asking(self) -> None:
        while not self._closed.is_set():
            try:
                answer = self._ask()
            except Exception as exc:  # a look that fails changes nothing; the silence grows
                log.debug("%s: no answer: %s", self._name, exc)
            else:
                with self._lock:
                    now = self._clock()
                    self._longest_ended_s = max(self._longest_ended_s, now - self._answered_at)
                    self._latest = answer
                    self._answered_at = self._last_answer_at = now
            self._closed.wait(self._every_s)


class HeadState(enum.Enum):
    ANSWERING = "answering"
    SILENT = "silent"


@dataclass(frozen=True)
class HeadSilence:
    """The GCS stopped answering at `from_step` (`over`: it answers again, after `seconds`).
    `to_step`: the furthest step heard while it was silent; None where the driver's loop was held
    up through the whole silence (a rollback waiting for the GCS to start a lost shard again)."""

    from_step: int
    seconds: float
    over: bool
    to_step: int | None = None

    def outcome(self) -> str:
        """What the run did meanwhile, for the fault told once the silence is over."""
        if self.to_step is None:
            return "the run went on once it answered"
        trained = self.to_step - self.from_step
        if trained <= 0:
            return "the run went on, no step trained meanwhile"
        return f"training went on, {trained} step(s) meanwhile"

    def describe(self) -> str:
        if not self.over:
            return (
                f"the cluster's head (its GCS) has not answered for {self.seconds:.0f} s, since step "
                f"{self.from_step}: training goes on; Ray waits for a lost head to come back "
                "(GCS fault tolerance) or gives up after RAY_gcs_rpc_server_reconnect_timeout_s"
            )
        return (
            f"the cluster's head (its GCS) did not answer for {self.seconds:.0f} s, from step "
            f"{self.from_step} (a head lost and started again, or one too busy to answer)"
        )


class HeadWatch:
    """Tells once when `answers` fall silent for `silent_after_s`, and once when they come back;
    a silence that began and ended between two looks (a loop held up meanwhile) is told once,
    as over, from the answers' own record."""

    def __init__(self, answers: BackgroundAnswer, silent_after_s: float = SILENT_AFTER_S) -> None:
        self._answers = answers
        self._silent_after_s = silent_after_s
        self.state = HeadState.ANSWERING
        self._from_step = 0
        self._to_step = 0
        self._longest_s = 0.0

    def look(self, step: int) -> HeadSilence | None:
        silent_s = self._answers.silent_s()
        ended_s = self._answers.take_longest_silence()
        if self.state is HeadState.ANSWERING:
            if ended_s >= self._silent_after_s:  # not seen while it lasted
                return HeadSilence(self._from_step, ended_s, over=True)
            if silent_s < FRESH_S:
                self._from_step = step  # the last step seen while it answered
            if silent_s < self._silent_after_s:
                return None
            self.state, self._longest_s, self._to_step = HeadState.SILENT, silent_s, step
            return HeadSilence(self._from_step, silent_s, over=False)
        if silent_s >= self._silent_after_s:
            self._longest_s, self._to_step = max(self._longest_s, silent_s), max(self._to_step, step)
            return None
        self.state = HeadState.ANSWERING
        # The silence lasted until the answer that ended it (the longest seen is within a look's
        # period of it); the steps heard at this look may have come after it.
        return HeadSilence(self._from_step, max(self._longest_s, ended_s), over=True, to_step=self._to_step)
