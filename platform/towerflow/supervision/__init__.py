"""Built-in hooks: what MonitoredTrainingSession did for one process, for a Ray cluster."""

from towerflow.supervision.checkpoints import CheckpointSaverHook
from towerflow.supervision.evaluation import EvalHook
from towerflow.supervision.factory import build_supervision_hooks, load_user_hooks
from towerflow.supervision.nan_guard import NanGuardHook
from towerflow.supervision.profiler import ProfilerHook
from towerflow.supervision.stop import StopAtStepHook

__all__ = [
    "CheckpointSaverHook",
    "EvalHook",
    "NanGuardHook",
    "ProfilerHook",
    "StopAtStepHook",
    "build_supervision_hooks",
    "load_user_hooks",
]
