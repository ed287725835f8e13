"""Helpers for tests: tiny real TFRecord data sets and small valid specs."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import tensorflow as tf

_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


def write_tfrecords(folder: Path, name: str, columns: dict[str, np.ndarray], shards: int) -> list[str]:
    """Write columns (int64 or float32 arrays, first axis = examples) as `name-0000i-of-0000n` shards."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(next(iter(columns.values())))
    bounds = np.linspace(0, n, shards + 1).astype(int)
    files = []
    for s in range(shards):
        path = folder / f"{name}-{s:05d}-of-{shards:05d}"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for i in range(bounds[s], bounds[s + 1]):
                feature = {}
                for key, col in columns.items():
                    value = np.asarray(col[i]).reshape(-1)
                    if col.dtype.kind in "iu":
                        feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=value.tolist()))
                    else:
                        feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=value.tolist()))
                writer.write(
                    tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
                )
        files.append(path.name)
    return files


def blobs(n: int, dim: int = 8, classes: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Linearly separable-ish Gaussian blobs with example ids."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2, size=(classes, dim)).astype(np.float32)
    labels = rng.integers(0, classes, size=n)
    x = centers[labels] + rng.normal(0, 1, size=(n, dim)).astype(np.float32)
    return {
        "x": x.astype(np.float32),
        "label": labels.astype(np.int64),
        "example_id": np.arange(n, dtype=np.int64),
    }


def write_manifest(folder: Path, name: str, files: list[str], per_file: list[int], dim: int) -> None:
    """`folder`'s manifest.json for TFRecord shards of blob-like examples (x float32 [dim], label,
    example_id): its files' example counts let a resumed or re-planned stream start past the files
    trained on."""
    features = {"x": {"dtype": "float32", "shape": [dim]}}
    features |= {k: {"dtype": "int64", "shape": []} for k in ("label", "example_id")}
    train = {"files": files, "examples": sum(per_file), "per_file": per_file}
    manifest = {"name": name, "format": "tfrecord", "label": "label", "splits": {"train": train}}
    (folder / "manifest.json").write_text(json.dumps(manifest | {"features": features}))


# The smallest cluster: one worker and one shard, for tests whose subject is not how many there are.
# Each actor's process imports TensorFlow (seconds of CPU on 2 cores), so every actor counts.
ONE_OF_EACH = {"workers": 1, "ps": 1}


def blob_spec(folder: Path, **sections) -> dict:
    """A small valid raw spec over blob_data; keyword sections replace or extend the defaults."""
    spec = {
        "name": "blobs-test",
        "model": {
            "ref": "models.mlp:build",
            "params": {"input_dim": 8, "num_classes": 2, "hidden": [16], "seed": 1},
            "loss": "sparse_categorical_crossentropy",
            "from_logits": True,
            "metrics": ["accuracy"],
        },
        "data": {
            "train": {"paths": str(folder / "train-*")},
            "batch_size": 32,
            "epochs": 1,
            "shuffle_files": False,
        },
        "cluster": {"workers": 2, "ps": 2, "cpus_per_worker": 1, "cpus_per_ps": 0.5},
        "training": {"mode": "sync", "max_steps": 10, "optimizer": {"name": "sgd", "learning_rate": 0.1}},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def tracked_spec(
    folder: Path, data_dir: Path, experiment: str, /, *, tracking: dict | None = None, **sections
):
    """(validated blob spec, its tracking URI): a fresh SQLite MLflow store in `folder`, `experiment`."""
    from towerflow.spec import validate_spec

    uri = sqlite_store(folder)
    raw = blob_spec(
        data_dir, tracking={"tracking_uri": uri, "experiment": experiment, **(tracking or {})}, **sections
    )
    return validate_spec(raw), uri


def example_bytes(features: dict) -> bytes:
    """One serialized tf.train.Example from {name: list of ints | list of floats | list of bytes}."""
    feature = {}
    for key, values in features.items():
        values = list(values)
        if values and isinstance(values[0], bytes):
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
        elif values and isinstance(values[0], float):
            feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
        else:
            feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_examples(path: Path, examples: list[dict]) -> Path:
    """A TFRecord file of hand-made Examples (see example_bytes), e.g. with a broken one among them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for example in examples:
            writer.write(example_bytes(example))
    return path


def write_uneven_shards(
    folder: Path, sizes: list[int], dim: int = 4, seed: int = 0, without_x: Collection[int] = ()
) -> list[Path]:
    """TFRecord shards of the given sizes holding x (float32 [dim]), label and a unique example_id;
    the examples whose ids are in `without_x` lack their x (bad records)."""
    rng = np.random.default_rng(seed)
    paths, next_id = [], 0
    for s, size in enumerate(sizes):
        examples = [
            {
                "x": rng.normal(size=dim).astype(np.float32).tolist(),
                "label": [int(i % 2)],
                "example_id": [next_id + i],
            }
            for i in range(size)
        ]
        for example in examples:
            if example["example_id"][0] in without_x:
                del example["x"]
        paths.append(write_examples(folder / f"train-{s:05d}-of-{len(sizes):05d}", examples))
        next_id += size
    return paths


def write_csv(path: Path, header: list[str] | None, rows: list[list]) -> Path:
    """A CSV file written by hand (so rows can be broken on purpose)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [",".join(header)] if header else []
    lines += [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def tabular_rows(n: int, features: int = 3, seed: int = 0, start_id: int = 0) -> list[list]:
    """CSV rows: example_id, f0..f{k-1} (floats), label (0/1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        x = rng.normal(size=features)
        rows.append([start_id + i, *(repr(float(v)) for v in x), int(x.sum() > 0)])
    return rows


def tabular_header(features: int = 3) -> list[str]:
    return ["example_id", *(f"f{j}" for j in range(features)), "label"]


def truncate(path: Path, drop_bytes: int) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[:-drop_bytes])
    return path


def flip_byte(path: Path, offset: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


@functools.cache
def _store_template() -> Path:
    """An empty store made by MLflow, once per session, in a process of its own started in the
    template's folder: every engine closed before the copies, and the Default experiment (which
    towerflow never uses) kept out of the repository."""
    template = Path(tempfile.mkdtemp(prefix="towerflow-test-store-")) / "mlflow.db"
    made = (
        "import sys; from mlflow.tracking import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()"
    )
    done = subprocess.run(
        [sys.executable, "-c", made, f"sqlite:///{template}"],
        cwd=template.parent,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return template


def sqlite_store(folder: Path) -> str:
    """The URI of a new, empty MLflow SQLite store `folder/mlflow.db`: a copy of `_store_template()`.
    MLflow runs its whole migration history on every store it creates (over a second of CPU each,
    some forty times a suite); the copy is the same file it would have written."""
    path = folder / "mlflow.db"
    if not path.exists():
        shutil.copyfile(_store_template(), path)
    return f"sqlite:///{path}"


def ray_actors(class_name: str) -> list[dict]:
    """The connected Ray's actors of this class, dead ones included (the GCS's actor table:
    `ray.util.state` would need the dashboard)."""
    from ray._private.state import actors

    return [a for a in actors().values() if a["ActorClassName"].endswith(class_name)]


@contextlib.contextmanager
def mlflow_uri(uri: str) -> Iterator[None]:
    """Point MLflow's global tracking URI at a test store for a block."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)


def free_ports(count: int = 1) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (all held open until every one is chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def takes_ctrl_c() -> None:
    """Popen's preexec_fn: the child acts on SIGINT (Ctrl-C) however the suite was started (a
    shell's background job ignores SIGINT, and a child inherits that)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ray_data_claims(ray) -> set[str]:
    """The executions Ray Data's autoscaling coordinator (a detached actor) splits the cluster's
    cores between: each keeps a share until it is shut down, or for 180 s after it last spoke."""
    from ray.data._internal.cluster_autoscaler import get_or_create_autoscaling_coordinator

    coordinator = get_or_create_autoscaling_coordinator()
    return set(ray.get(coordinator.__ray_call__.remote(lambda self: list(self._ongoing_reqs))))


def printed_by_a_fresh_process(code: str, env: dict[str, str] | None = None) -> list[str]:
    """The lines `python -c code` printed in a fresh process (one that has imported nothing yet, as
    an actor's or the CLI's), which must exit 0."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def unstamped(text: str) -> list[str]:
    """The lines of a command's output, each without the time it starts with where it is read later
    (towerflow.messages: a pipe, a job's log)."""
    return [_STAMP.sub("", line) for line in text.splitlines()]
