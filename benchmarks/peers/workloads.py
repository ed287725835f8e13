"""What every system in the peers benchmark shares: the workloads, the data, the run contract.

A runner (`peer_<system>.py` beside this file) is a script run in a fresh process by `peers.py`:

    python benchmarks/peers/peer_<system>.py --workload lenet --workers 2 --data DIR \
        --warmup 10 --steps 40 --snapshot-every 10 --out DIR [--mode sync|async]

It trains `--warmup` + `--steps` steps' worth of the global batch (async systems: the same number of
examples, however their updates are counted), saves the model's weights every `--snapshot-every`
steps' worth into `--out` (`Snapshots`), and prints one JSON line last (`RunReport`). The parent
evaluates every snapshot with one evaluator (`evaluate`), so accuracy means the same for all systems.

Clocks: `train_s` runs from the start of the first step; time a runner spends saving a snapshot is
left out of it (`TrainClock.paused`). `rate` covers the examples of the `--steps` timed steps after
the warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # models/ (the model zoo), in runners started as scripts and their actors


@dataclass(frozen=True)
class Workload:
    name: str
    model_ref: str  # towerflow's import string for the same architecture (Keras 3)
    global_batch: int
    learning_rate: float = 1e-3  # Adam everywhere
    target_accuracy: float = 0.9  # time to this eval accuracy is reported


WORKLOADS = {
    "lenet": Workload("lenet", "models.lenet:build", 256),  # compute-bound
    # The cost model's overhead term: a near-empty model's step is the platform's own (towerflow only).
    "tiny": Workload("tiny", "benchmarks.tiny_model:build", 64),
    "mlp": Workload(
        "mlp", "benchmarks.peers.workloads:mnist_mlp", 64, target_accuracy=0.85
    ),  # communication-bound
}


# -- the models, for any Keras (Keras 3 for towerflow and the plain runs, tf_keras for the peers that
#    need TF_USE_LEGACY_KERAS=1); the same layers in the same order, so weights move between them.
def lenet_with(keras: ModuleType) -> Any:
    """models.lenet, built with the given Keras module."""
    from models.lenet import build as lenet

    return lenet(keras=keras)


def mlp_with(keras: ModuleType) -> Any:
    """784-500-10 over the flattened image."""
    inputs = keras.Input(shape=(28, 28, 1), name="image")
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(500, activation="relu")(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")


def mnist_mlp(num_classes: int = 10) -> Any:
    """towerflow's model ref for the mlp workload (Keras 3)."""
    import keras

    assert num_classes == 10
    return mlp_with(keras)


BUILDERS = {"lenet": lenet_with, "mlp": mlp_with}


def build(workload: str, keras: ModuleType | None = None) -> Any:
    if keras is None:
        import keras
    return BUILDERS[workload](keras)


# -- data -------------------------------------------------------------------------------------------
def manifest(data: Path) -> dict:
    return json.loads((Path(data) / "manifest.json").read_text())


def split_files(data: Path, split: str) -> list[str]:
    return [str(Path(data) / name) for name in manifest(data)["splits"][split]["files"]]


def decode_images(raw: Sequence[bytes] | np.ndarray, scale: float = 1 / 255) -> np.ndarray:
    """Serialized uint8 images (the TFRecord `image` bytes) -> float32 [n, 28, 28, 1]."""
    flat = np.frombuffer(b"".join(bytes(r) for r in raw), dtype=np.uint8)
    return flat.reshape(-1, 28, 28, 1).astype(np.float32) * np.float32(scale)


def tf_dataset(data: Path, split: str = "train", batch: int = 256, files: Sequence[str] | None = None):
    """tf.data over the split's TFRecords: (images float32 [b,28,28,1], labels int64 [b]), repeated."""
    import tensorflow as tf

    scale = manifest(data)["features"]["image"].get("scale", 1 / 255)
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(serialized):
        parsed = tf.io.parse_example(serialized, spec)
        pixels = tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), [-1, 28, 28, 1])
        return tf.cast(pixels, tf.float32) * scale, parsed["label"]

    ds = tf.data.TFRecordDataset(list(files or split_files(data, split)), buffer_size=1 << 20)
    ds = ds.batch(batch, drop_remainder=True).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.repeat().prefetch(tf.data.AUTOTUNE)


def numpy_batches(data: Path, split: str, batch: int, limit: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The first `limit` examples of a split as numpy batches, read without TensorFlow's graph."""
    import tensorflow as tf

    scale = manifest(data)["features"]["image"].get("scale", 1 / 255)
    images, labels = [], []
    for record in tf.data.TFRecordDataset(split_files(data, split)).take(limit):
        example = tf.train.Example.FromString(record.numpy()).features.feature
        images.append(example["image"].bytes_list.value[0])
        labels.append(example["label"].int64_list.value[0])
    x, y = decode_images(images, scale), np.asarray(labels, np.int64)
    for start in range(0, len(y) - batch + 1, batch):
        yield x[start : start + batch], y[start : start + batch]


# -- the run contract ------------------------------------------------------------------------------
def runner_args(argv: list[str] | None = None, *, modes: Sequence[str] = ("sync",)) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="lenet")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "bench-mnist")
    parser.add_argument("--warmup", type=int, default=10, help="global batches before the timed window")
    parser.add_argument("--steps", type=int, default=40, help="global batches in the timed window")
    parser.add_argument(
        "--snapshot-every", type=int, default=0, help="global batches between snapshots (0: none)"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the snapshots")
    parser.add_argument("--mode", choices=modes, default=modes[0])
    parser.add_argument(
        "--ps", type=int, default=1, help="parameter-server shards, where the system has them"
    )
    parser.add_argument(
        "--fetch-every", type=int, default=1, help="towerflow async: steps between parameter fetches"
    )
    parser.add_argument(
        "--overlap-push", action="store_true", help="towerflow async: compute the next step during a push"
    )
    # A fault for benchmarks/faults_peers.py: one SIGKILL, at the first global batch done at or past --kill-at
    parser.add_argument(
        "--kill", choices=("worker", "ps"), help="SIGKILL worker 1's process, or PS 0's, once"
    )
    parser.add_argument("--kill-at", type=int, default=0, help="global batch at which --kill strikes")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="global batches between the system's own checkpoints, where it resumes from them (0: none)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.spec = WORKLOADS[args.workload]
    return args


class Progress:
    """The wall time of every global batch done, appended to `out/progress.log` as it happens, so
    that what a fault costs is read from it across a system's restarts (a restarted process
    appends to the same file)."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / "progress.log"
        self._last = 0

    def mark(self, step: int) -> None:
        if step == self._last:
            return
        self._last = step
        with self.path.open("a") as log:
            log.write(f"{step} {time.time():.6f}\n")  # finer than the kill's gap: before or after


class Kill:
    """`--kill` at `--kill-at`, once per run: the kill's wall time and step go to `out/kill.json`,
    which also tells a restarted process that it was done."""

    def __init__(self, target: str | None, at: int, out: Path) -> None:
        self.target, self.at = target, at  # target None: no kill
        self.path = Path(out) / "kill.json"

    def due(self, step: int) -> bool:
        return self.target is not None and step >= self.at and not self.path.exists()

    def strike(self, pid: int, step: int) -> None:
        self.path.write_text(json.dumps({"wall": time.time(), "step": step, "target": self.target}))
        os.kill(pid, signal.SIGKILL)


class TrainClock:
    """Seconds of training since the first step started, less the pauses a runner spends saving."""

    def __init__(self) -> None:
        self.process_start = time.time()
        self.started: float | None = None
        self._paused = 0.0

    def start(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def now(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started - self._paused

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is left off the clock."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - began


class Snapshots:
    """Weights every N global batches into `out/snap-<step>.npz`, off the training clock."""

    def __init__(self, out: Path, every: int, clock: TrainClock) -> None:
        self.out, self.every, self.clock = Path(out), every, clock
        self.taken: list[tuple[float, int, str]] = []  # (train_s, step, file)
        self._last = 0

    def due(self, step: int) -> bool:
        return bool(self.every) and step >= self._last + self.every

    def save(self, step: int, weights: Sequence[np.ndarray], at: float | None = None) -> None:
        """`at`: the train_s the weights belong to, where the system trains on while they are saved
        (nothing is paused then); by default now, with the clock paused while saving."""
        path = self.out / f"snap-{step:06d}.npz"
        if at is None:
            at = self.clock.now()
            with self.clock.paused():
                np.savez(path, *[np.asarray(w) for w in weights])
        else:
            np.savez(path, *[np.asarray(w) for w in weights])
        self.taken.append((at, step, path.name))
        self._last = step


@dataclass
class RunReport:
    system: str
    workload: str
    workers: int
    mode: str
    global_batch: int
    rate: float  # examples/sec over the timed window
    span_s: float  # the timed window's length
    steps: int  # global batches in the timed window
    startup_s: float  # process start -> first step done
    curve: list[tuple[float, int, float]] = field(default_factory=list)  # (train_s, step, loss)
    snapshots: list[tuple[float, int, str]] = field(default_factory=list)
    split: dict[str, float] = field(default_factory=dict)  # seconds per step, by phase, where known
    notes: list[str] = field(default_factory=list)
    # CPU seconds per global batch by process role (workers, shards, other: the driver, Ray's own
    # processes, the data pipeline), and the cores "other" kept busy, where the runner measures it
    cpu_per_batch: dict[str, float] = field(default_factory=dict)
    other_cores: float | None = None
    # train_s at the end of the first global batch: the origin time to accuracy is counted from,
    # the same for every system (some clocks start before the first step, some at it).
    first_batch_s: float = 0.0

    def emit(self) -> None:
        """The last line a runner prints: the parent reads it."""
        sys.stdout.flush()
        print("RESULT " + json.dumps(asdict(self)), flush=True)


def read_report(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise ValueError("the runner printed no RESULT line")
    return json.loads(lines[-1][len("RESULT ") :])


class StepTimes:
    """End times of global batches: the rate over the timed window, and the loss curve."""

    def __init__(self, clock: TrainClock, warmup: int, steps: int, global_batch: int) -> None:
        self.clock, self.warmup, self.steps, self.global_batch = clock, warmup, steps, global_batch
        self.ends: dict[int, float] = {}
        self.curve: list[tuple[float, int, float]] = []
        self.first_step_wall: float | None = None

    def record(self, step: int, loss: float | None = None, at: float | None = None) -> None:
        """`step`: global batches done so far (fractions floored by the caller); `at`: its train_s
        where the system says (default: now). Steps skipped over end now too."""
        now = self.clock.now() if at is None else at
        if self.first_step_wall is None:
            self.first_step_wall = time.time()
        for done in range(max(self.ends, default=0) + 1, step + 1):
            self.ends[done] = now
        if loss is not None:
            self.curve.append((now, step, float(loss)))

    @property
    def done(self) -> bool:
        return self.warmup + self.steps in self.ends

    def window(self) -> tuple[float, float]:
        """(examples/sec, seconds) between the ends of steps `warmup` and `warmup + steps`."""
        first = self.ends.get(self.warmup, 0.0)
        span = self.ends[self.warmup + self.steps] - first
        return self.steps * self.global_batch / span, span


def report(system: str, args: argparse.Namespace, times: StepTimes, snaps: Snapshots, **extra) -> RunReport:
    rate, span = times.window()
    started = times.first_step_wall or time.time()
    return RunReport(
        system=system,
        workload=args.workload,
        workers=args.workers,
        mode=args.mode,
        global_batch=args.spec.global_batch,
        rate=rate,
        span_s=span,
        steps=args.steps,
        startup_s=started - times.clock.process_start,
        curve=times.curve,
        snapshots=snaps.taken,
        first_batch_s=times.ends.get(1, 0.0),
        **extra,
    )


# -- the one evaluator ------------------------------------------------------------------------------
class Evaluator:
    """Loss and accuracy of saved weights on the first `examples` eval examples (a Keras 3 model)."""

    def __init__(self, workload: str, data: Path, examples: int = 2048) -> None:
        self.model = build(workload)
        self.batches = list(numpy_batches(data, "eval", 256, examples))

    def __call__(self, snapshot: Path) -> tuple[float, float]:
        """(mean eval loss, eval accuracy) of the weights in a snapshot file."""
        import keras

        with np.load(snapshot) as saved:
            weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        self.model.set_weights(weights)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        right = total = 0
        loss = 0.0
        for x, y in self.batches:
            logits = self.model(x, training=False)
            loss += float(loss_fn(y, logits))
            right += int((np.argmax(logits, axis=-1) == y).sum())
            total += len(y)
        return loss / total, right / total
