"""Find the state to resume from, with errors that say what was looked at."""

from __future__ import annotations

from towerflow.checkpoint.state import TrainingState
from towerflow.checkpoint.stores import CheckpointStore, latest_step
from towerflow.errors import SpecError


def latest_state(store: CheckpointStore, where: str) -> TrainingState:
    step = latest_step(store)
    if step is None:
        raise SpecError(f"--resume {where}: no complete checkpoint there to resume from")
    return store.load(step)
