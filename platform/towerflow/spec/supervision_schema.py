"""The job spec's `supervision` section: MonitoredTrainingSession's hooks and the user's own."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from towerflow.spec.strict import StrictModel


class CheckpointSpec(StrictModel):
    """CheckpointSaver: TensorFlow's defaults (every 600 s when no interval is given, keep 5)."""

    enabled: bool = True
    every_steps: int | None = Field(None, gt=0)
    every_secs: float | None = Field(
        None, gt=0, description="600 when neither every_steps nor every_secs is set."
    )
    max_to_keep: int = Field(5, ge=1)
    keep_checkpoint_every_n_hours: float | None = Field(None, gt=0)
    at_end: bool = Field(True, description="Also save when training ends normally.")

    @property
    def interval_secs(self) -> float | None:
        return 600.0 if self.every_steps is None and self.every_secs is None else self.every_secs


class StopAtStepSpec(StrictModel):
    num_steps: int | None = Field(None, gt=0, description="Steps to run from the (restored) start.")
    last_step: int | None = Field(None, gt=0, description="Global step to stop at.")

    @model_validator(mode="after")
    def _one_of(self) -> StopAtStepSpec:
        if (self.num_steps is None) == (self.last_step is None):
            raise ValueError("give exactly one of num_steps and last_step")
        return self


class ProfileSpec(StrictModel):
    """Profile global steps [start_step, stop_step) on the chosen workers."""

    start_step: int = Field(ge=0)
    stop_step: int = Field(gt=0)
    workers: list[int] = Field(default_factory=lambda: [0])

    @model_validator(mode="after")
    def _window(self) -> ProfileSpec:
        if self.stop_step <= self.start_step:
            raise ValueError(f"stop_step ({self.stop_step}) must be after start_step ({self.start_step})")
        return self


EvalMetric = Literal["loss", "accuracy", "precision", "recall", "auc", "mse", "mae", "rmse", "perplexity"]


class EvalSpec(StrictModel):
    """Evaluate the current parameters on data.eval every `every_steps` global steps (and at the end)."""

    every_steps: int = Field(gt=0)
    metrics: list[EvalMetric] = Field(default_factory=lambda: ["loss", "accuracy"])
    max_batches: int | None = Field(None, gt=0, description="Evaluate on at most this many batches.")
    batch_size: int | None = Field(None, gt=0, description="Defaults to data.batch_size.")
    at_end: bool = True


class HookRef(StrictModel):
    ref: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="module.path:ClassOrFactory")
    params: dict[str, Any] = Field(default_factory=dict)


class SupervisionSpec(StrictModel):
    """The built-in hooks (MonitoredTrainingSession's) and user hooks by import string."""

    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    stop_at_step: StopAtStepSpec | None = None
    log_every_steps: int = Field(100, gt=0, description="Metrics to MLflow every N global steps.")
    nan_guard: Literal["fail", "stop", "skip", "off"] = "fail"
    profile: ProfileSpec | None = None
    eval: EvalSpec | None = None
    worker_start_delay_steps: int = Field(
        0, ge=0, description="GlobalStepWaiter: worker k starts after global step k * this."
    )
    hooks: list[HookRef | str] = Field(default_factory=list)
