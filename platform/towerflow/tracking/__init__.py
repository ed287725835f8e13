"""Tracking: hooks that record runs in MLflow (the runtime itself imports no MLflow)."""

from towerflow.tracking.mlflow_tracker import MLflowTracker
from towerflow.tracking.store import default_tracking_uri

__all__ = ["MLflowTracker", "default_tracking_uri"]
