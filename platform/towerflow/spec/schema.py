"""The typed job spec: one YAML file, validated into these models.

Every model forbids unknown keys, so a typo fails with the key's dotted path instead of being ignored.
Defaults follow TensorFlow's where TensorFlow had one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from towerflow.spec.strict import StrictModel
from towerflow.spec.supervision_schema import SupervisionSpec
from towerflow.spec.training_schema import TrainingSpec

FunctionRef = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]  # module.path:function


class FeatureSpec(StrictModel):
    """One feature of a record (or one CSV column): its stored type and shape, how raw bytes decode,
    and, for variable-length features, how they become dense (padded) or stay ragged."""

    dtype: Literal["int64", "float32", "bytes"]
    shape: list[int] = Field(default_factory=list)
    default: Any = None
    decode: Literal["uint8", "float32"] | None = None
    decoded_shape: list[int] | None = None
    scale: float | None = None
    varlen: bool = Field(
        False, description="Variable length: padded to pad_to (or the batch's longest), or ragged."
    )
    pad_to: int | None = Field(None, gt=0, description="varlen: pad (or cut) every record to this length.")
    ragged: bool = Field(False, description="varlen: hand the model a tf.RaggedTensor instead of padding.")

    @model_validator(mode="after")
    def _decode_needs_bytes(self) -> FeatureSpec:
        if self.decode is not None and self.dtype != "bytes":
            raise ValueError(f"decode: {self.decode} applies to dtype bytes only, not {self.dtype}")
        if (self.pad_to is not None or self.ragged) and not self.varlen:
            raise ValueError("pad_to and ragged apply to varlen: true features only")
        if self.ragged and self.pad_to is not None:
            raise ValueError("a varlen feature is either ragged or padded to pad_to, not both")
        if self.varlen and self.decode is not None:
            raise ValueError("decode applies to fixed-length bytes features, not varlen ones")
        return self


class CsvSpec(StrictModel):
    """How CSV shards are laid out; column types come from `features`, the manifest, or inference."""

    header: bool = True
    delimiter: str = Field(",", min_length=1, max_length=1)
    columns: list[str] | None = Field(None, description="Column names, needed only without a header row.")


class SourceSpec(StrictModel):
    """Where one split's shards live and what their records hold."""

    paths: str | list[str]
    format: Literal["tfrecord", "csv"] = "tfrecord"
    label: str = "label"
    features: dict[str, FeatureSpec] | None = None
    csv: CsvSpec = Field(default_factory=CsvSpec)
    groups: dict[str, list[str]] | None = Field(
        None,
        description="name: [features or globs]: one dense float32 tensor, concatenated on the last axis.",
    )
    preprocess: list[FunctionRef] = Field(
        default_factory=list, description="module:fn applied per batch in Ray Data (dict of NumPy arrays)."
    )
    tower_preprocess: list[FunctionRef] = Field(
        default_factory=list,
        description="module:fn(features, training) -> features, per tower in TensorFlow.",
    )

    @property
    def path_list(self) -> list[str]:
        return [self.paths] if isinstance(self.paths, str) else list(self.paths)


class DataSpec(StrictModel):
    train: SourceSpec
    eval: SourceSpec | None = None
    batch_size: int = Field(128, gt=0, description="Examples per worker per step, split across its towers.")
    epochs: int | None = Field(1, gt=0, description="null: repeat until training.max_steps.")
    shuffle_files: bool = True
    shuffle_buffer: int = Field(
        0,
        ge=0,
        description="Per-worker local shuffle buffer, in examples; 0 = off. Above 0 the rows a worker used "
        "are no longer the first of its blocks: a lost worker's hand-over and a re-plan's position may "
        "skip or repeat up to that many examples per loss (shuffle_files keeps them exact).",
    )
    drop_remainder: bool = Field(True, description="Drop a worker's last partial batch of the run.")
    seed: int = 0
    on_bad_record: Literal["error", "skip"] = Field(
        "error", description="error: stop the job naming the file and record; skip: drop and count them."
    )
    prefetch_batches: int = Field(2, ge=0, description="Batches each worker keeps ready ahead of its step.")
    readahead_mb: float = Field(
        256, gt=0, description="Object-store memory Ray Data may fill ahead of the workers (MiB)."
    )
    deterministic: bool = Field(False, description="Keep block order (preserve_order); slower.")
    executor_step_ms: float = Field(
        20,
        ge=0,
        description="Shortest step of Ray Data's scheduling loop (ms): keeps a backpressured pipeline "
        "from spinning on a core; steps last up to 250 ms while no worker waits for a block; "
        "0 = Ray's own pace.",
    )


class ModelSpec(StrictModel):
    ref: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="module.path:function")
    params: dict[str, Any] = Field(default_factory=dict)
    loss: Literal[
        "sparse_categorical_crossentropy", "categorical_crossentropy", "binary_crossentropy", "mse", "mae"
    ] = "sparse_categorical_crossentropy"
    from_logits: bool = False
    metrics: list[Literal["accuracy", "mse", "mae"]] = Field(default_factory=list)


class ClusterSpec(StrictModel):
    workers: int = Field(
        1,
        ge=1,
        description="Workers; {min: M, max: N} for an elastic run (this is then N, the most it grows to).",
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        description="Elastic runs: the fewest workers to train with; set by workers: {min, max}.",
    )
    ps: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1,
        description=(
            "Parameter-server shards; auto: the fewest whose step the cost model puts within a tenth "
            "of the best any count gives (towerflow/runtime/cost_model.py), resolved when the job starts."
        ),
    )
    gpus_per_worker: float = Field(0, ge=0)
    towers: int = Field(1, ge=1, description="Towers per worker; with GPUs, one per GPU.")
    cpus_per_worker: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description=(
            "CPUs per worker, and so its TensorFlow's threads; auto: on an embedded Ray, each worker's share "
            "of the machine's cores after the shards' and Ray Data's; on a cluster joined, the most that still "
            "places every worker beside them on the nodes, within the CPUs free (runtime/worker_cpus.py)."
        ),
    )
    cpus_per_ps: float = Field(0.5, gt=0)
    spare_workers: int = Field(
        0,
        ge=0,
        description=(
            "Warm spare workers (not with an elastic run, whose pending workers are its spares): started "
            "with the run (TensorFlow imported, model built) and idle, each holding a worker's CPUs and GPUs "
            "in the run's placement groups. A lost worker's place is taken by a spare, not by a new process; "
            "a new spare starts in the lost one's place. 0 (default): a new worker is started."
        ),
    )
    spare_shards: int = Field(
        0,
        ge=0,
        description=(
            "Warm spare shards: started with the run (TensorFlow imported) and idle, each holding "
            "cpus_per_ps in the run's placement groups. A lost shard's place is taken by a spare, not by a "
            "new process, which takes the process's start off the rollback; a new spare starts in the "
            "lost one's place. 0 (default): a new shard is started."
        ),
    )
    data_cpus: float = Field(1.0, gt=0, description="Logical CPUs kept free for Ray Data's read tasks.")
    placement: Literal["spread", "pack", "strict_spread", "strict_pack"] = Field(
        "spread",
        description=(
            "How the shards and workers are laid over the nodes (Ray placement groups of that strategy): "
            "spread (default) over as many nodes as it can, the shards apart from each other first; pack "
            "onto as few; strict_ insists."
        ),
    )
    placement_timeout_s: float = Field(
        600, gt=0, description="How long the run waits for Ray to place its shards and workers."
    )
    keep_actors_s: float = Field(
        30,
        ge=0,
        description=(
            "Seconds a finished run's shards and workers (TensorFlow started) wait, their reservations "
            "held, for the next run of the same placement in this driver process (a sweep, `towerflow "
            "compare`, runs in a notebook), which takes them instead of starting new processes; "
            "0: they end with the run. Not for elastic runs."
        ),
    )
    sharding: Literal["round_robin", "greedy_bytes"] = "greedy_bytes"
    min_slice_bytes: int | None = Field(
        262144,
        ge=1,
        description="Cut variables into per-shard row slices of at least this size; null: never cut.",
    )
    push_bucket_bytes: int | None = Field(
        None,
        ge=1,
        description=(
            "Sync mode: push gradients in buckets of about this size while backprop still runs (layers "
            "nearest the loss first), so shards apply them while workers compute. Pays where the backward "
            "pass leaves CPU cores free (GPU workers); null (default): one push a step, after backprop."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _worker_range(cls, data: Any) -> Any:
        """`workers: {min: M, max: N}` is stored as workers: N, min_workers: M."""
        if isinstance(data, dict) and isinstance(data.get("workers"), dict):
            bounds = dict(data["workers"])
            unknown = sorted(set(bounds) - {"min", "max"})
            if unknown or "max" not in bounds:
                raise ValueError(
                    f"workers: {data['workers']} must be a number or {{min: M, max: N}} "
                    f"({'unknown key ' + ', '.join(unknown) if unknown else 'max is missing'})"
                )
            data = {**data, "workers": bounds["max"], "min_workers": bounds.get("min", 1)}
        return data

    @property
    def fewest_workers(self) -> int:
        """The fewest workers the run trains with: min_workers if elastic, else workers."""
        return self.min_workers if self.min_workers is not None else self.workers

    @property
    def elastic(self) -> bool:
        return self.fewest_workers < self.workers

    @property
    def worker_processes(self) -> int:
        """The workers' and spare workers' processes, each holding a worker's CPUs and GPUs."""
        return self.workers + self.spare_workers

    @property
    def shard_processes(self) -> int:
        """The shards' and spare shards' processes, each holding `cpus_per_ps` (`ps: auto` counted as 1,
        until it is resolved)."""
        return (1 if self.ps == "auto" else self.ps) + self.spare_shards

    @property
    def towers_per_worker(self) -> int:
        """The towers a worker builds: one per GPU it is given (a fraction is one GPU), else `towers`."""
        return max(self.towers, int(self.gpus_per_worker))

    @model_validator(mode="after")
    def _towers_match_gpus(self) -> ClusterSpec:
        gpus = self.gpus_per_worker
        if gpus >= 1 and self.towers not in (1, int(gpus)):
            raise ValueError(
                f"towers: {self.towers} must be 1 or equal gpus_per_worker ({int(gpus)}) on GPU workers"
            )
        if gpus > 1 and gpus != int(gpus):
            raise ValueError(f"gpus_per_worker: {gpus} must be a whole number when above 1")
        if self.min_workers is not None and self.min_workers > self.workers:
            raise ValueError(f"workers: min {self.min_workers} exceeds max {self.workers}")
        if self.spare_workers and self.elastic:
            raise ValueError(
                f"spare_workers: {self.spare_workers} is for a fixed worker count; an elastic run "
                "(workers: {min, max}) keeps pending workers as its spares: set spare_workers: 0"
            )
        return self


class TrackingSpec(StrictModel):
    experiment: str | None = None
    tracking_uri: str | None = None
    run_name: str | None = None
    system_metrics: bool = Field(
        True, description="CPU, memory, disk, network and NVIDIA GPU metrics per Ray node."
    )
    system_metrics_interval_s: float = Field(10.0, gt=0, description="Seconds between system metric samples.")


class ExportSpec(StrictModel):
    saved_model: bool = False
    register_as: str | None = Field(
        None, pattern=r"^[^/:]+$", description="Registered model name (no / or :)."
    )
    alias: str = Field(
        "champion", pattern=r"^[\w-]+$", description="Alias of the new version ('latest', v<N> are reserved)."
    )


class TFConfigSpec(StrictModel):
    memory_growth: bool = True
    memory_limit_mb: int | None = Field(None, gt=0)
    soft_placement: bool = True
    log_device_placement: bool = False


class JobSpec(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*$")
    model: ModelSpec
    data: DataSpec
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    tf_config: TFConfigSpec = Field(default_factory=TFConfigSpec)
    supervision: SupervisionSpec = Field(default_factory=SupervisionSpec)

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        t, workers = self.training, self.cluster.workers
        if t.max_steps is None and self.data.epochs is None:
            raise ValueError("training.max_steps and data.epochs are both null: the job would never end")
        if t.total_num_replicas is not None and t.total_num_replicas != workers:
            raise ValueError(
                f"training.total_num_replicas: {t.total_num_replicas} must equal cluster.workers ({workers})"
            )
        if t.mode == "sync":
            if t.replicas_to_aggregate is not None and t.replicas_to_aggregate > workers:
                raise ValueError(
                    f"training.replicas_to_aggregate: {t.replicas_to_aggregate} exceeds cluster.workers "
                    f"({workers}); sync training would wait forever"
                )
            if t.max_staleness is not None:
                raise ValueError(
                    "training.max_staleness applies to mode: async only (sync drops every stale gradient)"
                )
            if t.fetch_every != 1:
                raise ValueError(
                    f"training.fetch_every: {t.fetch_every} applies to mode: async only (a sync step "
                    "needs the parameters of the step before it)"
                )
            if t.overlap_push:
                raise ValueError(
                    "training.overlap_push applies to mode: async only (a sync step needs the "
                    "parameters of the step before it)"
                )
        towers = self.cluster.towers_per_worker
        if self.data.batch_size < towers:
            raise ValueError(
                f"data.batch_size: {self.data.batch_size} examples per worker cannot feed its {towers} towers "
                "(each needs at least one); raise data.batch_size or lower cluster.towers"
            )
        if self.supervision.eval is not None and self.data.eval is None:
            raise ValueError("supervision.eval needs data.eval (the evaluation data)")
        delay = self.supervision.worker_start_delay_steps
        if delay and t.mode == "sync" and self.replicas_to_aggregate > 1:
            raise ValueError(
                "supervision.worker_start_delay_steps needs mode: async (or sync with replicas_to_aggregate: 1): "
                "a sync step that waits for a worker which waits for that step would never come"
            )
        profile = self.supervision.profile
        if profile is not None and any(w >= workers for w in profile.workers):
            raise ValueError(
                f"supervision.profile.workers: {profile.workers} names a worker >= cluster.workers ({workers})"
            )
        return self

    @property
    def replicas_to_aggregate(self) -> int:
        return self.training.replicas_to_aggregate or self.cluster.workers

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name
