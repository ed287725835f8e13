"""What an actor does as a memory checkpoint's holder (runtime/memory_checkpoints.py): keep another
shard's state, copied out of the object store, give it back to the shard that takes that shard's
place, and let it go once a newer checkpoint is complete. Mixed into the parameter shard (a peer's
or a spare's copy) and the tower worker (the copy of a run with one shard and no spare)."""

from __future__ import annotations

import dataclasses

import numpy as np

from towerflow.runtime.shard_parts import ShardSnapshot


class HeldCopies:
    """The actor sets `_peer_copies = {}` as it starts: (shard id, version) -> that shard's state."""

    _peer_copies: dict[tuple[int, int], ShardSnapshot]

    def hold_peer_copy(self, kept: ShardSnapshot) -> None:
        """Keep a shard's state (its part of a memory checkpoint), copied out of the object store:
        the copy must outlive the shard that sent it, which owns the store's."""
        self._peer_copies[(kept.shard_id, kept.version)] = dataclasses.replace(
            kept,
            values=[np.array(v) for v in kept.values],
            slots={slot: [np.array(a) for a in arrays] for slot, arrays in kept.slots.items()},
        )

    def peer_copy(self, shard_id: int, version: int) -> ShardSnapshot:
        """Shard `shard_id`'s state at `version`, as it sent it here, for the shard in its place."""
        kept = self._peer_copies.get((shard_id, version))
        if kept is None:
            held = sorted(self._peer_copies)
            raise KeyError(
                f"{type(self).__name__} holds no copy of shard {shard_id} at {version} (holds {held})"
            )
        return kept

    def checkpoint_committed(self, version: int) -> None:
        """The checkpoint of `version` is complete: the copies held of older ones can go."""
        self._peer_copies = {key: kept for key, kept in self._peer_copies.items() if key[1] >= version}

    def _drop_copies_after(self, version: int) -> None:
        """The shards went back to `version`: copies of later ones belong to the timeline left."""
        self._peer_copies = {key: kept for key, kept in self._peer_copies.items() if key[1] <= version}
