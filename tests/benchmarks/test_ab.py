"""ab.py's reading of a config's per-round ratios: a change shows on one side in every round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from ab import reading  # noqa: E402


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([0.913, 0.824, 0.828], "slower in every round"),
        ([1.187, 1.075, 1.153], "faster in every round"),
        ([0.945, 0.941, 1.021], "rounds disagree: within the swing"),  # the same code an hour later
        ([0.97, 0.98, 0.99], "within the swing"),
        ([0.872, 0.886, 1.014], "rounds disagree: within the swing"),  # a docs-only commit's
    ],
)
def test_a_change_shows_in_every_round_not_in_a_median(ratios, expected):
    assert reading(ratios) == expected
