"""Ray actor helpers (runtime/actors.py): an error's first line, for a log or a loss's cause."""

from __future__ import annotations

from towerflow.runtime.actors import first_line


def test_a_long_error_line_is_cut_at_a_word_and_marked():
    long = RuntimeError("The actor is unavailable: " + "connection refused " * 30 + "\ntraceback ...")
    cut = first_line(long, limit=80)
    assert cut.endswith(" ...") and len(cut) <= 84
    assert cut[: -len(" ...")].endswith("refused") or cut[: -len(" ...")].endswith("connection")
    assert first_line(RuntimeError("short\nsecond line")) == "short"
    assert first_line(RuntimeError("")) == "RuntimeError"
