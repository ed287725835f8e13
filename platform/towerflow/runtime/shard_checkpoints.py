"""A parameter shard's checkpoint side (mixed into `ParameterShard`): the state it starts from, the
snapshots it takes at chosen versions while training goes on, and the part of a checkpoint it
writes from its own node. The shard provides its variables, slots, optimizer and version."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import numpy as np

from towerflow.runtime.held_copies import HeldCopies
from towerflow.runtime.shard_parts import (
    LiveState,
    OwnCopy,
    PartReport,
    PartSource,
    ShardSnapshot,
    write_shard_part,
)

_SNAPSHOTS_KEPT = 3  # periodic snapshots a shard holds until the chief collects them


class ShardCheckpoints(HeldCopies):
    def _reset_snapshots(self, snapshot_every: int | None) -> None:
        self._snapshot_at: set[int] = set()
        self._snapshot_every = snapshot_every  # capture every N versions by itself: exact checkpoint steps
        self._snapshots: dict[int, ShardSnapshot] = {}
        self._snapshot_waiting: collections.Counter[int] = collections.Counter()  # version -> callers waiting

    def _starting_state(
        self,
        names: list[str],
        initial_values: list[np.ndarray] | PartSource | OwnCopy | ShardSnapshot | LiveState,
        initial_slots: dict[str, list[np.ndarray]] | None,
        initial_version: int,
    ) -> tuple[list[np.ndarray] | None, dict[str, list[np.ndarray]] | None]:
        """The values and slots to load: as given, this shard's own copy of a checkpoint it wrote or
        of a memory checkpoint (a rollback), the copy a peer held for the shard it replaces, what it
        holds now (a new driver's), or read from the store; (None, None) where this node cannot
        reach the store. Sets `_loaded_from`."""
        self._loaded_from = "values from the driver"
        # Copies from beyond the version loaded belong to a timeline abandoned by a rollback.
        self._written = {v: kept for v, kept in self._written.items() if v <= initial_version}
        self._drop_copies_after(initial_version)
        if isinstance(initial_values, LiveState):
            if list(self._names) != list(names):
                raise RuntimeError(f"shard {self.shard_id} holds other pieces than the run's layout gives it")
            self._loaded_from = f"its live state of step {self._version}"
            live = self._capture()
            return live.values, dict(live.slots)
        own = self._written.get(initial_version)
        if own is not None and own.names != names:
            own = None  # a copy of other pieces than these
        from_own = isinstance(initial_values, OwnCopy) or (  # a rollback to a memory checkpoint, or ...
            isinstance(initial_values, PartSource)  # ... to a stored one this shard wrote
            and initial_values.own_copy_ok
            and own is not None
            and own.version == initial_values.checkpoint.global_step
        )
        if from_own:
            if own is None:
                raise RuntimeError(f"shard {self.shard_id} holds no copy of its state at {initial_version}")
            with_slots = not isinstance(initial_values, PartSource) or initial_values.with_slots
            self._loaded_from = f"its own copy of step {own.version}"
            return own.values, dict(own.slots) if with_slots else None
        if isinstance(initial_values, ShardSnapshot):  # the copy a peer held of the lost shard's state
            self._loaded_from = f"a peer's copy of step {initial_values.version}"
            return initial_values.values, dict(initial_values.slots)
        if isinstance(initial_values, PartSource):
            source = initial_values
            if not source.checkpoint.reader.reachable():
                return None, None
            initial_values, slots = source.checkpoint.read_part(source.part, source.with_slots)
            initial_slots = dict(zip(source.checkpoint.slot_names, slots)) if source.with_slots else None
            self._loaded_from = f"{source.part} of step {source.checkpoint.global_step}"
        return initial_values, initial_slots

    async def snapshot(self, version: int) -> ShardSnapshot:
        """The state at `version`: now if the shard is there, else as soon as an update reaches it.

        Shards reach every version one update at a time, so asking all shards for the same future
        version gives a consistent cut without pausing training. A shard that ends before it gets
        there (end of data, stop) answers with its final state; the caller checks the versions.
        """
        waiting = self._snapshot_waiting
        if self._version < version and not self._done:
            self._snapshot_at.add(version)
            waiting[version] += 1
            try:
                await self._wait_for(lambda: self._version >= version or self._done)
            finally:
                waiting[version] -= 1
        # The last of those that waited for it takes it away (a memory checkpoint and a stored one
        # may ask for the same next version); one asking after that gets the state it finds.
        if waiting[version] > 0:
            kept = self._snapshots.get(version)
        else:
            kept = self._snapshots.pop(version, None)
            waiting.pop(version, None)
        return kept if kept is not None else self._capture()

    async def write_checkpoint(self, version: int, writer: Any, part: str, term: int = 0) -> PartReport:
        """Write this shard's state at `version` (as `snapshot` finds it) as part `part` of the
        checkpoint `writer` writes (checkpoint/stores.py), from this node, in a thread: training
        goes on meanwhile. Where this node cannot write to the store, the part's files go back to
        the chief to write instead. Refused to a driver of an earlier term than this shard's
        (runtime/fencing.py), before and after the wait for `version`."""
        self._obey(term, "writing a checkpoint part")
        kept = await self.snapshot(version)
        self._obey(term, "writing a checkpoint part")
        if kept.version != writer.step:
            return PartReport(kept.version)
        from towerflow.checkpoint.files import all_finite

        slot_names = sorted(kept.slots)
        if not all_finite(kept.values + [a for name in slot_names for a in kept.slots[name]]):
            return PartReport(kept.version, finite=False)
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(None, write_shard_part, kept, slot_names, writer, part)
        self._written[kept.version] = kept
        return report

    async def copy_to_peer(self, version: int, holder: Any) -> int:
        """This shard's part of a memory checkpoint: its state at `version` (as `snapshot` finds
        it), kept here and copied to `holder` (another shard, a spare shard or a worker:
        `HeldCopies`), which gives it back should this one be lost. Returns the version kept;
        another than `version`: nothing was kept."""
        kept = await self.snapshot(version)
        if kept.version != version:
            return kept.version
        await holder.hold_peer_copy.remote(kept)
        self._written[version] = kept
        return version

    def checkpoint_committed(self, version: int) -> None:
        """The checkpoint of `version` (stored, or held in the shards' memory) is complete: older
        copies of this shard's state, and of the others' it holds, can go."""
        self._written = {v: kept for v, kept in self._written.items() if v >= version}
        super().checkpoint_committed(version)

    def _snapshot_if_due(self) -> None:
        """At a new version: capture it where a snapshot was asked for or falls due."""
        every = self._snapshot_every
        if self._version in self._snapshot_at or (every and self._version % every == 0):
            self._snapshot_at.discard(self._version)
            self._snapshots[self._version] = self._capture()
            for old in sorted(self._snapshots)[:-_SNAPSHOTS_KEPT]:  # nobody came for these
                del self._snapshots[old]

    def _capture(self) -> ShardSnapshot:
        return ShardSnapshot(
            self.shard_id,
            self._version,
            list(self._names),
            [v.numpy() for v in self._variables],
            {slot: [s[slot].numpy() for s in self._slots] for slot in self._optimizer.slot_names},
        )
