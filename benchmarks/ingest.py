"""Ingest speed: the towerflow path against tf.data on the same shards, TFRecord and CSV.

towerflow: shards -> Ray Data parse tasks (tf.io.parse_example on whole batches, or pyarrow's CSV
reader) -> the worker's split -> batches made ready for a tower (raw bytes decoded and scaled to
float32, CSV columns grouped into one dense tensor) inside a consumer Ray actor.
tf.data: TFRecordDataset -> batch -> parse_example + decode_raw + scale (or CsvDataset -> batch ->
stack), with parallel reads and AUTOTUNE, in a child process of its own.

Each run reads the data set for several epochs: the first epoch, timed from the moment the
pipeline is built, is the cold start (process start-up, TensorFlow import in Ray Data's workers,
graph building); the later epochs give the steady state. Rounds interleave the four
configurations; medians are reported.

    python benchmarks/ingest.py            # 3 rounds x 3 epochs of 60k MNIST and 60k CSV rows
    python benchmarks/ingest.py --quick    # 1 round, 2 epochs

The last line is `ingest_vs_tfdata=<steady-state towerflow TFRecord ex/s / tf.data ex/s>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import ensure_mnist, machine, make_log

ROOT = Path(__file__).resolve().parents[1]
BATCH = 128
RAY_WORKER_NICENESS = 15  # the raylet starts Ray's worker processes at this niceness
CSV_FEATURES = 32
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


log = make_log("ingest")


# -- data ------------------------------------------------------------------------------------------


def ensure_csv(folder: Path, examples: int = 60000, shards: int = 8) -> None:
    """Tabular CSV shards with a manifest (the data contract's layout): example_id, f00..f31, label."""
    if (folder / "manifest.json").is_file():
        return
    import pyarrow as pa
    import pyarrow.csv as pacsv

    log(f"generating {examples} CSV rows into {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, CSV_FEATURES)).astype(np.float32)
    label = (x[:, :4].sum(axis=1) > 0).astype(np.int64)
    names = [f"f{j:02d}" for j in range(CSV_FEATURES)]
    bounds = np.linspace(0, examples, shards + 1).astype(int)
    files = []
    for s in range(shards):
        lo, hi = bounds[s], bounds[s + 1]
        table = pa.table(
            {
                "example_id": np.arange(lo, hi),
                **{n: x[lo:hi, j] for j, n in enumerate(names)},
                "label": label[lo:hi],
            }
        )
        name = f"train-{s:05d}-of-{shards:05d}.csv"
        pacsv.write_csv(table, folder / name, pacsv.WriteOptions(quoting_style="none"))
        files.append(name)
    features = {"example_id": {"dtype": "int64", "shape": []}}
    features.update({n: {"dtype": "float32", "shape": []} for n in names})
    features["label"] = {"dtype": "int64", "shape": []}
    manifest = {
        "name": "tabular",
        "format": "csv",
        "generator": "benchmarks/ingest.py",
        "seed": 0,
        "label": "label",
        "csv": {"header": True, "delimiter": ","},
        "splits": {
            "train": {
                "pattern": "train-*",
                "files": files,
                "examples": examples,
                "per_file": np.diff(bounds).tolist(),
            }
        },
        "features": features,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


# -- tf.data (child process) -----------------------------------------------------------------------


def tfdata_run(kind: str, folder: str, epochs: int) -> dict:
    import tensorflow as tf

    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    files = [str(Path(folder) / f) for f in manifest["splits"]["train"]["files"]]
    start = time.perf_counter()
    if kind == "tfrecord":
        spec = {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64),
            "example_id": tf.io.FixedLenFeature([], tf.int64),
        }
        scale = manifest["features"]["image"]["scale"]

        def parse(serialized):
            parsed = tf.io.parse_example(serialized, spec)
            image = tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), [-1, 28, 28, 1])
            return {"image": tf.cast(image, tf.float32) * scale}, parsed["label"]

        ds = tf.data.TFRecordDataset(files, num_parallel_reads=tf.data.AUTOTUNE, buffer_size=1 << 20)
        ds = ds.batch(BATCH).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        columns = list(manifest["features"])
        defaults = [
            tf.constant([], tf.int64 if manifest["features"][c]["dtype"] == "int64" else tf.float32)
            for c in columns
        ]

        def one_file(path):
            return tf.data.experimental.CsvDataset(path, defaults, header=True).batch(BATCH)

        def group(*cols):
            return {"x": tf.stack(cols[1:-1], axis=-1)}, cols[-1]

        ds = tf.data.Dataset.from_tensor_slices(files).interleave(
            one_file, cycle_length=len(files), num_parallel_calls=tf.data.AUTOTUNE
        )
        ds = ds.map(group, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    marks = []
    for _ in range(epochs):
        seen = 0
        for _, labels in ds:
            seen += int(labels.shape[0])
        marks.append((time.perf_counter(), seen))
    return _rates(start, marks)


def _rates(start: float, marks: list[tuple[float, int]]) -> dict:
    """Cold: the first epoch from the start; steady: the later epochs."""
    first_t, first_n = marks[0]
    last_t = marks[-1][0]
    later = sum(n for _, n in marks[1:])
    return {
        "cold": first_n / (first_t - start),
        "steady": later / (last_t - first_t) if later else float("nan"),
        "examples": [n for _, n in marks],
    }


def tfdata(kind: str, folder: Path, epochs: int) -> dict:
    # Same niceness as Ray's workers, so other jobs on the machine slow both alike.
    out = subprocess.run(
        [
            "nice",
            "-n",
            str(RAY_WORKER_NICENESS),
            sys.executable,
            __file__,
            "--tfdata-child",
            kind,
            str(folder),
            str(epochs),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- towerflow -------------------------------------------------------------------------------------


def towerflow_run(ray, kind: str, folder: Path, epochs: int, data_cpus: float) -> dict:
    from towerflow.data.ingest import build_training_data
    from towerflow.runtime.batches import BatchAdapter
    from towerflow.runtime.protocol import step_shape
    from towerflow.spec import validate_spec

    train = {"paths": str(folder / "train-*"), "format": kind, "label": "label"}
    if kind == "csv":
        train["groups"] = {"x": ["f*"]}
    spec = validate_spec(
        {
            "name": "ingest-bench",
            "model": {"ref": "models.mlp:build"},
            "data": {"train": train, "batch_size": BATCH, "epochs": epochs, "shuffle_files": True},
            "cluster": {"workers": 1, "ps": 1, "data_cpus": data_cpus},
            "training": {"mode": "sync"},
        }
    )
    start = time.perf_counter()
    data = build_training_data(spec, 1, step_shape(spec.training.mode, spec.replicas_to_aggregate))
    per_epoch = data.examples_per_epoch
    input_name = "image" if kind == "tfrecord" else "x"

    def consume(stream, scales, per_epoch):
        """The worker's side: batches of BATCH, made ready for a tower (decoded, scaled, grouped)."""
        adapter = BatchAdapter([input_name], "label", scales, stream.options.varlen)
        marks, seen = [], 0
        for batch in stream.batches(batch_size=BATCH, drop_last=False, shuffle_buffer=0, seed=0):
            inputs, labels = adapter(batch)
            assert inputs.dtype == np.float32
            seen += len(labels)
            if seen % per_epoch < BATCH:  # an epoch boundary (60k is not a multiple of 128)
                marks.append((time.perf_counter(), seen - sum(n for _, n in marks)))
        return marks

    remote = ray.remote(num_cpus=1)(consume)
    marks = ray.get(remote.remote(data.splits[0], data.feature_scales, per_epoch))
    return _rates(start, marks)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round, 2 epochs")
    parser.add_argument("--data-cpus", type=float, default=2.0, help="cluster.data_cpus for towerflow")
    parser.add_argument("--data", type=Path, default=ROOT / "data", help="where the data sets are made")
    parser.add_argument(
        "--tfdata-child", nargs=3, metavar=("KIND", "FOLDER", "EPOCHS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.tfdata_child:
        kind, folder, epochs = args.tfdata_child
        print(json.dumps(tfdata_run(kind, folder, int(epochs))))
        return
    if args.quick:
        args.rounds, args.epochs = 1, 2
    began = time.time()
    folders = {"tfrecord": args.data / "bench-mnist", "csv": args.data / "bench-csv"}
    ensure_mnist(folders["tfrecord"], log)
    ensure_csv(folders["csv"])

    import ray

    sys.path.insert(0, str(ROOT))
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    results: dict[str, list[dict]] = {}
    configs = [("tf.data", "tfrecord"), ("towerflow", "tfrecord"), ("tf.data", "csv"), ("towerflow", "csv")]
    for r in range(args.rounds):
        order = configs[r % 2 :] + configs[: r % 2]  # rotate who goes first
        for system, kind in order:
            log(f"round {r + 1}/{args.rounds}: {system} {kind}")
            load = os.getloadavg()[0]
            if system == "tf.data":
                found = tfdata(kind, folders[kind], args.epochs)
            else:
                found = towerflow_run(ray, kind, folders[kind], args.epochs, args.data_cpus)
            found["load"] = (load + os.getloadavg()[0]) / 2
            log(
                f"  cold {found['cold']:,.0f} ex/s, steady {found['steady']:,.0f} ex/s, load {found['load']:.1f}"
            )
            results.setdefault(f"{system} {kind}", []).append(found)
    ray.shutdown()

    def median(key: str, phase: str) -> float:
        return statistics.median(run[phase] for run in results[key])

    print(f"# towerflow ingest benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"machine: {machine()}")
    print(
        f"{args.rounds} round(s) x {args.epochs} epochs of 60,000 examples; batch {BATCH}; "
        f"towerflow data_cpus={args.data_cpus:g} + a 1-CPU consumer actor; tf.data AUTOTUNE in its own process"
    )
    print()
    print(
        f"{'configuration':<22}{'steady ex/s':>14}{'min':>10}{'max':>10}{'cold ex/s':>12}{'vs tf.data':>12}{'load':>7}"
    )
    ratios = {}
    for kind in ("tfrecord", "csv"):
        base = median(f"tf.data {kind}", "steady")
        for system in ("tf.data", "towerflow"):
            key = f"{system} {kind}"
            steady = [run["steady"] for run in results[key]]
            ratio = median(key, "steady") / base
            ratios[f"{system} {kind}"] = ratio
            print(
                f"{key:<22}{median(key, 'steady'):>14,.0f}{min(steady):>10,.0f}{max(steady):>10,.0f}"
                f"{median(key, 'cold'):>12,.0f}{ratio:>12.3f}{median(key, 'load'):>7.1f}"
            )
    print(
        "(steady: epochs 2+ of a run; cold: its first epoch from building the pipeline; load: the machine's"
    )
    print(" 1-minute load average around the runs, medians; tf.data runs at Ray's worker niceness)")
    print()
    print(f"wall time of the whole benchmark: {time.time() - began:.0f} s")
    print(f"cold_vs_tfdata={median('towerflow tfrecord', 'cold') / median('tf.data tfrecord', 'cold'):.3f}")
    print(f"csv_vs_tfdata={ratios['towerflow csv']:.3f}")
    print(f"ingest_vs_tfdata={ratios['towerflow tfrecord']:.3f}")


if __name__ == "__main__":
    main()
