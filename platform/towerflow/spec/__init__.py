"""Typed job spec: YAML in, validated `JobSpec` out, with `--set` overrides."""

from towerflow.spec.loading import apply_override, flatten_spec, load_spec, validate_spec
from towerflow.spec.schema import (
    ClusterSpec,
    DataSpec,
    FeatureSpec,
    JobSpec,
    ModelSpec,
    SourceSpec,
)
from towerflow.spec.training_schema import OptimizerSpec, TrainingSpec

__all__ = [
    "ClusterSpec",
    "DataSpec",
    "FeatureSpec",
    "JobSpec",
    "ModelSpec",
    "OptimizerSpec",
    "SourceSpec",
    "TrainingSpec",
    "apply_override",
    "flatten_spec",
    "load_spec",
    "validate_spec",
]
