"""A memory checkpoint's holder (a shard, a spare, or a worker): what it keeps, gives back and lets go."""

from __future__ import annotations

import numpy as np
import pytest

from towerflow.runtime.held_copies import HeldCopies
from towerflow.runtime.shard_parts import ShardSnapshot


class Holder(HeldCopies):
    def __init__(self) -> None:
        self._peer_copies = {}


def _snapshot(version: int) -> ShardSnapshot:
    values = np.full(3, float(version))
    values.flags.writeable = False  # as an argument read from Ray's object store arrives
    return ShardSnapshot(0, version, ["w"], [values], {"m": [values * 2]})


def test_a_held_copy_is_its_own_and_given_back_by_shard_and_version():
    holder, sent = Holder(), _snapshot(10)
    holder.hold_peer_copy(sent)
    kept = holder.peer_copy(0, 10)
    assert kept.values[0] is not sent.values[0] and kept.values[0].flags.owndata
    np.testing.assert_array_equal(kept.slots["m"][0], [20.0, 20.0, 20.0])
    with pytest.raises(KeyError, match=r"Holder holds no copy of shard 0 at 11 \(holds \[\(0, 10\)\]\)"):
        holder.peer_copy(0, 11)


def test_a_newer_checkpoint_lets_older_copies_go_and_a_rollback_later_ones():
    holder = Holder()
    for version in (10, 20, 30):
        holder.hold_peer_copy(_snapshot(version))
    holder.checkpoint_committed(20)
    assert sorted(holder._peer_copies) == [(0, 20), (0, 30)]
    holder._drop_copies_after(20)
    assert sorted(holder._peer_copies) == [(0, 20)]
