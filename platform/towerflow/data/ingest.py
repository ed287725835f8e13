"""Build the training stream: shard files -> Ray Data parse tasks -> one stream per worker.

Epochs are laid out as one pass over the file list repeated (re-shuffled per epoch), so the whole
run is a single Ray Data execution: no barrier between workers at epoch boundaries, and parse
processes (with TensorFlow imported) stay warm for the whole run.

What an epoch means, and the remainder rule:
- Each file of an epoch is read by exactly one parse task and each of its blocks goes to exactly
  one worker, so every example of every epoch reaches exactly one worker (this needs no
  `preserve_order`: Ray Data may reorder blocks, never duplicate or drop them).
- sync: `streaming_split(equal=True)`: every worker receives the same number of examples over the
  run, so no worker runs dry while the others wait at the aggregation. Ray Data leaves out fewer
  than `workers` examples at the very end of the run to make the shares equal, and with
  `drop_remainder: true` each worker also drops its final partial batch of the run: at most
  `workers x batch_size - 1` examples of the last epoch go unused, earlier epochs are complete.
- async: `equal=False`: a faster worker takes more blocks; no example is dropped by the split, no
  worker waits for another. An epoch is then a pass over the data by all workers together: its
  examples are spread across workers by their speed, and the epochs overlap at their boundaries.
- `data.epochs` and `training.max_steps` both bound the run; whichever is reached first ends it.

A resumed run picks the stream up where its checkpoint left it (`resume_point`): the epochs
already trained, then the whole files of the current epoch that its examples seen account for,
are not read again. The cut is exact with `data.deterministic` (blocks in file order); otherwise
it is right to within the blocks that were in flight. Without a manifest giving each file's
example count, the position is unknown and the stream starts over.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass, field
from typing import Any

from towerflow.data.bad_records import BadRecords, make_ledger
from towerflow.data.csv import CsvLayout, read_csv_file
from towerflow.data.features import ColumnPlan, expand_groups
from towerflow.data.infer import resolve_features
from towerflow.data.node_files import check_every_node_sees
from towerflow.data.sources import examples_per_file, read_manifest, resolve_files
from towerflow.data.splits import resumable_streaming_split
from towerflow.data.tfrecord import read_tfrecord_file, tensorflow_for_reading
from towerflow.errors import DataError
from towerflow.shared_types import StepShape, StreamOptions, WorkerStream

UNBOUNDED_EPOCHS = 1000  # data.epochs: null with an unknown data set size
# One Ray Data block (one read task) per file to read, up to this many; beyond it, blocks of several
# files in a row (`read_runs`). Ray Data spends about a millisecond a block before the first batch,
# so a long run over many epochs (data.epochs: null, a large max_steps) would otherwise wait
# minutes to start.
MAX_READ_BLOCKS = 1024
MIB = 1 << 20


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run's stream starts: after `epoch` whole epochs and `files` whole files of
    the next one, which hold `examples` examples in all."""

    epoch: int = 0
    files: int = 0
    examples: int = 0


@dataclass
class TrainingData:
    splits: list[Any]  # WorkerStream, one per worker
    features: dict[str, dict[str, Any]]
    feature_scales: dict[str, float]
    files: list[str]
    epochs: int
    examples_per_epoch: int | None
    groups: dict[str, list[str]] = field(default_factory=dict)
    ledger: Any = None  # SkippedRecordsLedger actor in on_bad_record: skip
    dataset: Any = None  # the Ray Data dataset before the split (stats, tests)
    resume_note: str | None = None  # where a resumed run's stream starts, for the user
    steps: int | None = None  # the most global steps these streams make (None: counts unknown)
    reader: ShardReader | None = None  # what the read tasks run
    reads_spread: bool = True  # read tasks go over the nodes (else they stay near the driver's)
    # The data position the streams start at: the examples before the first file they read (a
    # partly read file is read again from its start, so it can be below the position asked for).
    position: int = 0


@dataclass
class ShardReader:
    """Reads one shard file into model-ready column batches (runs inside Ray Data tasks)."""

    format: str
    features: dict[str, dict[str, Any]]
    plan: ColumnPlan
    layout: CsvLayout = field(default_factory=CsvLayout)
    on_bad_record: str = "error"
    ledger: Any = None

    def warm(self) -> None:
        """Import what reading a shard takes (TensorFlow for TFRecord, the preprocess functions), so
        that a read task in this process starts at once."""
        if self.format != "csv":
            tensorflow_for_reading()
        self.plan.functions()

    def __call__(self, path: str):
        bad = BadRecords(self.on_bad_record, self.ledger)
        if self.format == "csv":
            batches = read_csv_file(path, self.layout, self.features, bad)
        else:
            batches = read_tfrecord_file(path, self.features, bad)
        try:
            for columns in batches:
                yield self.plan(columns)
        finally:
            bad.report(path)


@dataclass
class PreparedSplit:
    """One split of the spec's data, resolved: its files, features and the reader of its shards."""

    files: list[str]
    manifest: dict[str, Any] | None
    features: dict[str, dict[str, Any]]
    groups: dict[str, list[str]]
    reader: ShardReader

    @property
    def varlen(self) -> dict[str, dict[str, Any]]:
        """Variable-length features that reach the towers unpadded, with how to batch them."""
        return {
            n: {"ragged": f["ragged"], "default": f["default"]}
            for n, f in self.features.items()
            if f["varlen"] and not f["pad_to"]
        }


def prepare_split(
    source: Any, key: str, on_bad_record: str = "error", ledger: Any = None, *, check_nodes: bool = True
) -> PreparedSplit:
    """Resolve `data.train` or `data.eval` (`key`); every error names the key it is about. With
    `check_nodes`, the cluster's other nodes are asked whether they see the files too."""
    files = resolve_files(source.path_list, key=f"{key}.paths")
    if check_nodes:
        check_every_node_sees(files, f"{key}.paths")
    manifest = read_manifest(files)
    layout = csv_layout(source, manifest)
    features = resolve_features(source, files, manifest, layout, key=key)
    if source.label not in features and source.label not in (source.groups or {}):
        raise DataError(
            f"{key}.label: {source.label!r} is neither a feature of the data nor a group "
            f"(features: {', '.join(features)})"
        )
    groups = expand_groups(source.groups, features, source.label)
    plan = ColumnPlan(features, groups, list(source.preprocess))
    plan.functions()  # a bad import string fails now, in the driver, not in a parse task
    reader = ShardReader(source.format, features, plan, layout, on_bad_record, ledger)
    return PreparedSplit(files, manifest, features, groups, reader)


def build_training_data(
    spec: Any,
    num_workers: int,
    shape: StepShape,
    *,
    examples_seen: int = 0,
    ledger: Any = None,
    check_nodes: bool = True,
) -> TrainingData:
    """The workers' streams for updates of `shape`; `examples_seen` (a resumed checkpoint's) makes
    them start after those. `ledger`: the run's skipped-records ledger, from its first pipeline (a
    re-planned one counts on in it: files read only before the re-plan keep their counts).
    `check_nodes`: ask the other nodes whether they see the files (data/node_files.py); a re-plan
    need not ask again, within a resize's pause."""
    import ray

    from towerflow.data.pacing import pace_scheduling_loop

    source, data = spec.data.train, spec.data
    if data.on_bad_record == "skip" and ledger is None:
        ledger = make_ledger()
    split = prepare_split(source, "data.train", data.on_bad_record, ledger, check_nodes=check_nodes)
    files, features, groups, reader = split.files, split.features, split.groups, split.reader

    counts = examples_per_file(files, split.manifest)
    per_epoch = None if counts is None else sum(counts.values())
    epochs = data.epochs or epochs_for_steps(spec, per_epoch, num_workers, shape, examples_seen)
    orders = epoch_file_orders(files, epochs, shuffle=data.shuffle_files, seed=data.seed)
    resume_note, position = None, examples_seen
    if examples_seen and counts is None:
        resume_note = (
            "the data position is unknown (no manifest with per-file example counts): the stream starts over"
        )
    elif examples_seen:
        start = resume_point(orders, counts, examples_seen)
        position = start.examples  # counted on from here: past it, a re-plan would skip examples
        orders = orders[start.epoch :]
        if orders:
            orders[0] = orders[0][start.files :]
        resume_note = (
            f"data resumes in epoch {start.epoch + 1}{f' of {epochs}' if data.epochs else ''}, "
            f"after {start.files} file(s) of it "
            f"({start.examples:,} of {examples_seen:,} examples seen skipped)"
        )
    ordered = [path for order in orders for path in order]
    if not ordered:
        bound = "data.epochs" if data.epochs else "training.max_steps (data.epochs is unset)"
        raise DataError(
            f"data.train: nothing left to read: the resumed run already trained on all {epochs} "
            f"epoch(s) ({examples_seen:,} examples). Raise {bound} to train further."
        )
    to_read = None if counts is None else sum(counts[path] for path in ordered)
    steps = None if to_read is None else steps_allowed(spec, num_workers, to_read, shape)
    if steps == 0:
        raise DataError(
            f"data.batch_size: {data.batch_size:,} examples per worker make no training step out of the "
            f"{to_read:,} examples to read ({source.paths}, {len(orders)} epoch(s)) split over {num_workers} "
            f"worker(s){' with drop_remainder' if data.drop_remainder else ''}. Lower data.batch_size, or "
            "raise data.epochs."
        )
    task_cpus = min(1.0, spec.cluster.data_cpus)
    placement = read_task_placement(spec.cluster.data_cpus, task_cpus)
    runs = read_runs(ordered)
    ds = ray.data.from_items([{"paths": run} for run in runs], override_num_blocks=len(runs))
    with warnings.catch_warnings():
        # A scheduling strategy has no named parameter in Ray 2.60 (pinned), only `ray_remote_args`,
        # which warns of its removal in Ray 2.64: a warning for Ray, not for a user's every run.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        ds = ds.map_batches(
            read_files, batch_size=1, fn_kwargs={"reader": reader}, num_cpus=task_cpus, **placement
        )
    bound_readahead(ds.context, spec.cluster.data_cpus, data.readahead_mb * MIB, data.deterministic)
    pace_scheduling_loop(ds.context, data.executor_step_ms / 1000)
    # Not the execution plan at INFO in every job's log: Ray forwards the split coordinator's lines
    # to a connected driver. Ray Data's own log file under the session's logs/ still has them.
    ds.context.print_on_execution_start = False
    # Nor Ray Data's own progress bars (the run's progress is towerflow's): in the split
    # coordinator each bar would send its state to a connected driver every second, and the
    # driver would say that tqdm is missing, the coordinator offer "a new progress UI", in every
    # job's log.
    ds.context.enable_progress_bars = False
    # Lockstep (sync): every worker gets the same number of examples. Async: faster workers take more.
    # A lost worker's replacement takes its split over, with what it had not used (data/splits.py).
    # Reading starts now, while the workers start: their first batch is then ready, or nearly.
    iterators = resumable_streaming_split(ds, num_workers, equal=shape.lockstep, prestart=True)
    options = StreamOptions(
        prefetch_batches=data.prefetch_batches,
        varlen=split.varlen,
        tower_preprocess=list(source.tower_preprocess),
    )
    grouped = _grouped(groups)
    scales = {
        name: f["scale"] for name, f in features.items() if f.get("scale") is not None and name not in grouped
    }
    return TrainingData(
        [WorkerStream(it, options) for it in iterators],
        features,
        scales,
        files,
        epochs,
        per_epoch,
        groups,
        ledger,
        ds,
        resume_note,
        steps,
        reader,
        reads_spread=not placement,
        position=position,
    )


def read_task_placement(data_cpus: float, task_cpus: float) -> dict[str, Any]:
    """The read tasks' Ray options. Ray Data spreads its tasks over the nodes, and each node's first
    read starts a process that imports TensorFlow (4-5 s of CPU here, and its memory for the rest
    of the run). A pipeline that reads one file at a time (`data_cpus` under two tasks' share) gains
    nothing from spreading: its reads take Ray's default strategy, which keeps them on the split
    coordinator's node (the driver's) while it has room."""
    if data_cpus >= 2 * task_cpus:
        return {}
    return {"scheduling_strategy": "DEFAULT"}


def bound_readahead(context: Any, cpus: float, object_store_bytes: float, deterministic: bool) -> None:
    """Keep Ray Data from reading the whole run ahead: cap its CPUs and object-store memory, and
    its blocks well below that cap so the cap can bite."""
    from ray.data import ExecutionResources

    options = context.execution_options
    options.resource_limits = ExecutionResources(cpu=cpus, object_store_memory=object_store_bytes)
    options.preserve_order = deterministic
    context.target_max_block_size = int(
        max(MIB, min(context.target_max_block_size or 1 << 30, object_store_bytes / 8))
    )


def read_files(batch: dict[str, Any], reader: ShardReader):
    """Ray Data map_batches function: runs of file paths in, parsed column batches out."""
    for run in batch["paths"]:
        for path in run:
            yield from reader(str(path))


def read_runs(paths: list[str], max_blocks: int = MAX_READ_BLOCKS) -> list[list[str]]:
    """`paths` in order, cut into at most `max_blocks` runs of consecutive files, one read task each.

    One file a run while there are few enough. Beyond that, the runs start at one file and double
    up to the even share of those left: Ray Data hands a task's output on only when the task ends
    (or fills a block), so the first batch waits for one file's read, not a whole run's (25 s for
    the 244 small files a run of a 999,999-step test held).
    """
    if len(paths) <= max_blocks:
        return [[path] for path in paths]
    runs: list[list[str]] = []
    start, size = 0, 1
    while len(runs) < max_blocks - 1 and size < math.ceil((len(paths) - start) / (max_blocks - len(runs))):
        runs.append(paths[start : start + size])
        start, size = start + size, size * 2
    share, extra = divmod(len(paths) - start, max_blocks - len(runs))
    for i in range(max_blocks - len(runs)):
        end = start + share + (i < extra)
        runs.append(paths[start:end])
        start = end
    return runs


def csv_layout(source: Any, manifest: dict[str, Any] | None) -> CsvLayout:
    """The spec's csv settings, with the manifest's filling what the spec leaves unset."""
    given = source.csv.model_fields_set
    from_manifest = (manifest or {}).get("csv") or {}
    header = source.csv.header if "header" in given else bool(from_manifest.get("header", True))
    delimiter = source.csv.delimiter if "delimiter" in given else from_manifest.get("delimiter", ",")
    columns = source.csv.columns
    if not columns and not header and (manifest or {}).get("features"):
        columns = list(manifest["features"])  # the contract: a CSV manifest lists every column in file order
    return CsvLayout(header=header, delimiter=delimiter, columns=tuple(columns) if columns else None)


def epoch_file_orders(files: list[str], epochs: int, *, shuffle: bool, seed: int) -> list[list[str]]:
    """Each epoch's file order; an epoch's shuffle depends on its number only, so a resumed run
    reads its remaining epochs in the order the first run would have."""
    orders = []
    for epoch in range(epochs):
        files_this_epoch = list(files)
        if shuffle:
            random.Random(seed * 100_003 + epoch).shuffle(files_this_epoch)
        orders.append(files_this_epoch)
    return orders


def resume_point(orders: list[list[str]], counts: dict[str, int], examples_seen: int) -> ResumePoint:
    """The whole epochs, then the whole files of the next epoch in its order, that `examples_seen`
    covers. A file only partly trained on is read again (at least once, never skipped)."""
    per_epoch = sum(counts.values())
    epoch, within = divmod(examples_seen, per_epoch) if per_epoch else (0, 0)
    if epoch >= len(orders):
        return ResumePoint(len(orders), 0, len(orders) * per_epoch)
    files = 0
    for path in orders[epoch]:
        if counts[path] > within:
            break
        within -= counts[path]
        files += 1
    return ResumePoint(epoch, files, examples_seen - within)


def steps_allowed(spec: Any, num_workers: int, examples: int, shape: StepShape) -> int:
    """The most global steps that `examples`, split over the workers as build_training_data splits
    them, can make. Lockstep (sync): each worker gets an equal share, and each update takes
    `shape.batches_per_update` of their batches. Async: every batch is an update."""
    batch, whole_batches_only = spec.data.batch_size, spec.data.drop_remainder
    if shape.lockstep:
        share = examples // num_workers
        batches = share // batch if whole_batches_only else -(-share // batch)
        return num_workers * batches // shape.batches_per_update
    # A worker's own last partial batch: dropped, or one more (smaller) update each.
    return examples // batch + (0 if whole_batches_only else num_workers)


def _grouped(groups: dict[str, list[str]]) -> set[str]:
    return {m for members in groups.values() for m in members}


def epochs_for_steps(
    spec: Any, per_epoch: int | None, num_workers: int, shape: StepShape, examples_seen: int = 0
) -> int:
    """Enough epochs for `training.max_steps`, and one more. A lockstep step takes a batch from
    every worker; an async step is one worker's batch. A re-plan from `examples_seen` on (a resume,
    a rollback, a resize) counts the epochs read already on top: its steps so far may have taken
    more examples each (more workers), and those it has left at most `max_steps` at this count.
    (More epochs than the run can use keep Ray Data's execution, its scheduling loop and read
    tasks, running for the whole run, where one sized to the run finishes reading once the run's
    data is read ahead.)"""
    if per_epoch is None or not spec.training.max_steps:
        return UNBOUNDED_EPOCHS
    batches_per_step = num_workers if shape.lockstep else 1
    needed = examples_seen + spec.training.max_steps * spec.data.batch_size * batches_per_step
    return max(1, math.ceil(needed / per_epoch)) + 1
