"""Tracking: hooks that record runs in MLflow (the runtime itself imports no MLflow).

Its names load on first use, so a command that needs only the store's address or the UI's (the
CLI) does not import the tracker's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from towerflow.tracking.mlflow_tracker import MLflowTracker
    from towerflow.tracking.store import default_tracking_uri

_HOMES = {
    "MLflowTracker": "towerflow.tracking.mlflow_tracker",
    "default_tracking_uri": "towerflow.tracking.store",
}
__all__ = ["MLflowTracker", "default_tracking_uri"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
