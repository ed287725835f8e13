"""Find the checkpoint to resume from, with errors that say what was looked at."""

from __future__ import annotations

from towerflow.checkpoint.stores import CheckpointStore, StoredCheckpoint, latest_step
from towerflow.errors import SpecError


def latest_checkpoint(store: CheckpointStore, where: str) -> StoredCheckpoint:
    """The newest complete checkpoint, opened (its meta read, its parts not yet)."""
    step = latest_step(store)
    if step is None:
        raise SpecError(f"--resume {where}: no complete checkpoint there to resume from")
    return store.open(step)
