"""Small helpers about Ray actors, for the driver's groups and the workers alike: the errors of an
actor that is gone, killing one that may be gone already, the answers that come in time, and an
error's first line for a log.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray

# Ray's errors for an actor that is gone (its process, or its node), as opposed to one its code raised.
ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)


def kill_quietly(actor: Any) -> None:
    """Kill an actor; one already dead (or Ray already gone) is fine."""
    with contextlib.suppress(Exception):
        ray.kill(actor)


def answers_within(
    refs: list[Any], timeout_s: float, tolerated: tuple[type[BaseException], ...] = (ray.exceptions.RayError,)
) -> list[Any]:
    """The answers of the calls `refs` that come within `timeout_s`; a call that fails with one of
    `tolerated` (its actor gone, by default any of Ray's errors) gives none, any other error is raised."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    answers = []
    for ref in ready:
        try:
            answers.append(ray.get(ref))
        except tolerated:
            continue
    return answers


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An error's first line (Ray's messages run to many), for a log line or a loss's cause; one
    longer than `limit` is cut at a word's end, marked with an ellipsis."""
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    line = text[0]
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def last_line(exc: BaseException) -> str:
    """An error's last line: for an actor that died as it started, the error its constructor raised
    (Ray's message ends with that error's traceback)."""
    text = str(exc).strip().splitlines()
    return text[-1].strip() if text else type(exc).__name__
