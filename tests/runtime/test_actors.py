"""Ray actor helpers (runtime/actors.py): an error's first and last lines, for a log or a loss's cause."""

from __future__ import annotations

from towerflow.runtime.actors import first_line, last_line


def test_a_long_error_line_is_cut_at_a_word_and_marked():
    long = RuntimeError("The actor is unavailable: " + "connection refused " * 30 + "\ntraceback ...")
    cut = first_line(long, limit=80)
    assert cut.endswith(" ...") and len(cut) <= 84
    assert cut[: -len(" ...")].endswith("refused") or cut[: -len(" ...")].endswith("connection")
    assert first_line(RuntimeError("short\nsecond line")) == "short"
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_the_last_line_is_the_error_a_failed_constructor_raised():
    died = RuntimeError(
        "The actor died because of an error raised in its creation task\n  File x\nValueError: bad\n"
    )
    assert last_line(died) == "ValueError: bad"
    assert last_line(RuntimeError("")) == "RuntimeError"
