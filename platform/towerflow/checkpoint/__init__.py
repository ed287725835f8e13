"""Checkpoints: the whole training state (all shards' variables and slots, global step, data position).

State is gathered per variable, not per shard, so a checkpoint restores onto any number of shards.
"""

from towerflow.checkpoint.files import read_checkpoint, write_checkpoint
from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.checkpoint.state import TrainingState, assemble_state, split_for_shards
from towerflow.checkpoint.stores import CheckpointStore, LocalCheckpointStore

__all__ = [
    "CheckpointStore",
    "LocalCheckpointStore",
    "MlflowCheckpointStore",
    "TrainingState",
    "assemble_state",
    "read_checkpoint",
    "split_for_shards",
    "write_checkpoint",
]
