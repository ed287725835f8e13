"""The job spec's `training` section: the update mode, the optimizer and its learning rate, and
what failures a run survives.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PositiveFloat, Tag, model_validator

from towerflow.spec.strict import StrictModel

OptimizerName = Literal["sgd", "momentum", "adam", "adagrad", "rmsprop"]

# Which optional optimizer fields mean something for which optimizer; anything else is a user mistake.
_OPTIMIZER_FIELDS: dict[str, set[str]] = {
    "sgd": set(),
    "momentum": {"momentum", "nesterov"},
    "adam": {"beta_1", "beta_2", "epsilon"},
    "adagrad": {"initial_accumulator_value", "epsilon"},
    "rmsprop": {"rho", "momentum", "epsilon", "centered"},
}


class LearningRateSchedule(StrictModel):
    schedule: Literal["constant", "exponential_decay"]
    initial_learning_rate: float = Field(gt=0)
    decay_steps: int | None = Field(None, gt=0)
    decay_rate: float | None = Field(None, gt=0)
    staircase: bool = False

    @model_validator(mode="after")
    def _decay_needs_rate(self) -> LearningRateSchedule:
        if self.schedule == "exponential_decay" and (self.decay_steps is None or self.decay_rate is None):
            raise ValueError("exponential_decay needs decay_steps and decay_rate")
        return self


def _rate_kind(value: Any) -> str:
    return "tag:schedule" if isinstance(value, dict | LearningRateSchedule) else "tag:constant"


# A number or a schedule. The discriminator makes an error show the branch the value meant,
# rather than both branches' complaints.
LearningRate = Annotated[
    Annotated[PositiveFloat, Tag("tag:constant")] | Annotated[LearningRateSchedule, Tag("tag:schedule")],
    Discriminator(_rate_kind),
]


class OptimizerSpec(StrictModel):
    name: OptimizerName = "sgd"
    learning_rate: LearningRate = 0.01
    clip_global_norm: float | None = Field(None, gt=0, description="Clip each replica's whole gradient.")
    momentum: float | None = Field(None, ge=0)
    nesterov: bool | None = None
    beta_1: float | None = Field(None, gt=0, lt=1)
    beta_2: float | None = Field(None, gt=0, lt=1)
    epsilon: float | None = Field(None, gt=0)
    rho: float | None = Field(None, gt=0, lt=1)
    centered: bool | None = None
    initial_accumulator_value: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _fields_fit_optimizer(self) -> OptimizerSpec:
        allowed = _OPTIMIZER_FIELDS[self.name]
        for field in set().union(*_OPTIMIZER_FIELDS.values()) - allowed:
            if getattr(self, field) is not None:
                options = ", ".join(sorted(allowed)) or "none"
                raise ValueError(f"{field} does not apply to {self.name} (its options: {options})")
        if self.name == "momentum" and self.momentum is None:
            self.momentum = 0.9
        return self

    def hyperparameters(self) -> dict[str, Any]:
        """The optimizer-specific settings that were given (Keras defaults fill the rest)."""
        return {
            k: getattr(self, k) for k in sorted(_OPTIMIZER_FIELDS[self.name]) if getattr(self, k) is not None
        }


class FailureSpec(StrictModel):
    """What a run survives (runtime/failure.py): lost workers are replaced, a lost parameter server
    rolls every shard back to the newest checkpoint (in the shards' memory, or stored); past a budget
    the run fails."""

    max_worker_failures: int = Field(3, ge=0, description="Workers lost (died or hung) a run survives.")
    max_ps_failures: int = Field(3, ge=0, description="Parameter servers lost a run survives.")
    worker_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A worker with no step (and no answer) for this long is hung: killed, replaced.",
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A replacement worker that has not started by then (no node with room for it) "
        "counts as one more worker lost; a replacement shard not started by then fails the run "
        "(resume it once the cluster has room); a run whose workers all wait this long for a batch fails.",
    )
    memory_checkpoint_every_s: float | None = Field(
        30.0,
        gt=0,
        description="With 2 or more parameter servers, or 1 and a warm spare shard (cluster.spare_shards): "
        "every this many seconds, each shard keeps its state at one common version in memory and sends "
        "a copy to another shard, or the spare (on another node wherever the placement allows). A lost "
        "shard then rolls the shards back to that version, not to the last stored checkpoint, unless "
        "the copy's holder was lost too. null: off.",
    )
    memory_checkpoint_draining_s: float | None = Field(
        2.0,
        gt=0,
        description="While a node holding a shard drains (a preempted or deleted pod's notice: Ray "
        "marks a node draining on SIGTERM, for up to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; `ray "
        "drain-node`; the autoscaler), memory checkpoints every this many seconds instead of "
        "memory_checkpoint_every_s, so that the shard's loss at the deadline redoes seconds of steps. "
        "Its shards cannot move before the node goes: their bundles stay there. null: no change.",
    )
    driver_grace_s: float | None = Field(
        300.0,
        gt=0,
        description="A tracked run's shards and workers outlive a lost driver by this long: a driver that "
        "resumes the run meanwhile (`--resume auto` or the run id, on the same Ray cluster) takes them over "
        "and goes on from the shards' live state, with no step redone, instead of from the stored "
        "checkpoint. Past it they are ended and their resources freed. null: they end with their driver.",
    )
    driver_restarts: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="`towerflow train` runs the driver as a child process and starts it again, up to this "
        "many times, where a signal killed it (the kernel's OOM killer, SIGKILL, a crash), resuming the "
        "same run: on a Ray cluster it takes the live shards and workers over (driver_grace_s); with nothing "
        "to resume yet (killed as the run started) it starts the same run over from step 0. A driver "
        "that exits, with an error or not, or a command that was stopped, is not started again. auto: 2 "
        "where the command joins a Ray cluster (RAY_ADDRESS: a Ray job, a RayJob), 0 on the embedded Ray "
        "(which a killed driver takes along, shards and all). 0: the command is the driver.",
    )


class TrainingSpec(StrictModel):
    mode: Literal["sync", "async"] = "sync"
    max_steps: int | None = Field(None, gt=0, description="Global steps (applied updates).")
    replicas_to_aggregate: int | None = Field(None, ge=1)
    total_num_replicas: int | None = Field(None, ge=1)
    max_staleness: int | None = Field(None, ge=0)
    fetch_every: int = Field(
        1,
        ge=1,
        description="Async only (Downpour's n_fetch): a worker takes new parameters every this many of "
        "its steps and computes on the ones it has in between; a shard publishes only the versions "
        "taken. Less traffic and shard work per step, staler gradients (by up to about fetch_every x "
        "workers updates).",
    )
    overlap_push: bool = Field(
        False,
        description="Async only (Downpour's asynchronous push): a worker computes its next step while "
        "its last push is on its way and reads the push's reply after that step, so the round trip "
        "no longer stalls it; its gradients are one of its own steps staler (the shards take its "
        "pushes in the order it sent them). Pays where the round "
        "trip is long against the compute (small models, GPU workers); null gain where the CPU is "
        "the bound.",
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    seed: int = 0
    failure: FailureSpec = Field(default_factory=FailureSpec)
