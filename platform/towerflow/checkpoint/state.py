"""The training state as whole variables, and the translations from and to shard pieces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from towerflow.shared_types import join_pieces


@dataclass
class TrainingState:
    """Everything a resume needs, keyed by variable name (model order kept in `names`)."""

    global_step: int
    optimizer: str
    names: list[str]
    variables: dict[str, np.ndarray]
    slots: dict[str, dict[str, np.ndarray]]  # slot name -> variable name -> value
    data_position: dict[str, Any] = field(default_factory=dict)
    # Non-trainable model variables by path (batch-norm moving statistics), averaged over workers.
    model_state: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def examples_seen(self) -> int:
        """Examples trained on up to this state: where a resumed run's data and counts go on from."""
        return int(self.data_position.get("examples_seen") or 0)

    def all_finite(self) -> bool:
        arrays = list(self.variables.values()) + [a for s in self.slots.values() for a in s.values()]
        arrays += list(self.model_state.values())
        return all(np.isfinite(a).all() for a in arrays if a.dtype.kind == "f")


def assemble_state(
    snapshots: list[Any],
    variables: list[Any],
    pieces: list[Any],
    assignment: list[list[int]],
    optimizer: str,
    data_position: dict[str, Any] | None = None,
) -> TrainingState:
    """Join the shards' snapshots (ShardSnapshot, in shard order) back into whole variables."""
    versions = {s.version for s in snapshots}
    if len(versions) != 1:
        raise ValueError(f"shards are at different versions {sorted(versions)}: not a consistent cut")
    slot_names = list(snapshots[0].slots)
    values = join_pieces([s.values for s in snapshots], pieces, assignment)
    slots = {slot: join_pieces([s.slots[slot] for s in snapshots], pieces, assignment) for slot in slot_names}
    names = [info.name for info in variables]
    return TrainingState(
        versions.pop(),
        optimizer,
        names,
        {info.name: values[info.index] for info in variables},
        {slot: {info.name: by_index[info.index] for info in variables} for slot, by_index in slots.items()},
        dict(data_position or {}),
    )


def split_for_shards(
    state: TrainingState, variables: list[Any], pieces: list[Any], assignment: list[list[int]], optimizer: str
) -> list[tuple[list[np.ndarray], dict[str, list[np.ndarray]] | None]]:
    """Per shard: the values of its pieces and their slots (None when the optimizer changed)."""
    names = [info.name for info in variables]
    missing = [n for n in names if n not in state.variables]
    if missing:
        raise ValueError(
            f"the checkpoint has no value for {', '.join(missing)} (it holds {', '.join(state.names)})"
        )
    for info in variables:
        stored = tuple(state.variables[info.name].shape)
        if stored != tuple(info.shape):
            raise ValueError(
                f"{info.name}: the checkpoint holds shape {stored}, the model has {tuple(info.shape)}"
            )
    keep_slots = state.optimizer == optimizer
    result = []
    for indices in assignment:
        values, slots = [], {slot: [] for slot in state.slots} if keep_slots else None
        for index in indices:
            piece = pieces[index]
            name = names[piece.variable]
            values.append(np.ascontiguousarray(piece.of(state.variables[name])))
            if slots is not None:
                for slot in slots:
                    slots[slot].append(np.ascontiguousarray(piece.of(state.slots[slot][name])))
        result.append((values, slots))
    return result
