"""The cost model's constants, measured, and the model checked against measured runs.

`measure` (a fresh process with a local Ray of its own) times the parts of a step one by one on
arrays the size of each workload's model: a worker's forward and backward pass alone (wall and CPU)
at each batch it runs, its gradients into the object store and parameters out of it into its
variables, a shard taking in one push, TensorFlow's fused Adam over the shard's variables, the
shard's publication of a version, an actor call's round trip, what an object through the object
store costs beyond its bytes (latency and the raylet's CPU); and, on a two-node Ray
(`ray.cluster_utils.Cluster`, each node its own object store), an object fetched across nodes.
costmodel_report.py sets the model (towerflow/runtime/cost_model.py) against every towerflow run of
the peers benchmark and projects it to 256 workers.

    python benchmarks/costmodel.py measure --out runs/bench/costs.json
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

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SINGLE_MACHINE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # towerflow.runtime.cluster's name for it
BATCHES = {"lenet": (64, 128, 256), "mlp": (16, 32, 64)}  # per-worker batches of 4, 2 and 1 workers


def _timed(fn, repeat: int) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds of this process) of `fn` over `repeat` calls."""
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def _paired_difference(fn, baseline, repeat: int) -> float:
    """Median over `repeat` back-to-back pairs of `fn`'s wall seconds less `baseline`'s: the drift
    of a busy machine between two separate medians (several times a small part's cost) cancels."""
    differences = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        middle = time.perf_counter()
        baseline()
        differences.append((middle - started) - (time.perf_counter() - middle))
    return statistics.median(differences)


def _probe_class():
    import ray

    @ray.remote(num_cpus=1)
    class Probe:
        """A process set up as a towerflow worker or shard (1 CPU: one intra-op thread)."""

        def __init__(self, workload: str) -> None:
            import sys

            sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
            from towerflow.runtime.tf_setup import TFProcessConfig, configure_tensorflow

            configure_tensorflow(TFProcessConfig(cpus=1))  # before any op: as a 1-CPU worker's
            import keras
            import tensorflow as tf
            from workloads import build

            from towerflow.runtime.optimizers import build_optimizer

            self.tf = tf
            self.model = build(workload, keras)
            self.weights = [np.asarray(w) for w in self.model.get_weights()]
            self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            self.optimizer = build_optimizer({"name": "adam", "learning_rate": 1e-3})
            self.slots = [
                {s: tf.Variable(np.zeros_like(w)) for s in self.optimizer.slot_names} for w in self.weights
            ]
            self.variables = [tf.Variable(w) for w in self.weights]

            @tf.function(reduce_retracing=True)
            def grads(x, y):
                with tf.GradientTape() as tape:
                    loss = self.loss(y, self.model(x, training=True))
                return tape.gradient(loss, self.model.trainable_variables)

            self._grads = grads

        def params(self) -> int:
            return int(sum(w.size for w in self.weights))

        def compute(self, batch: int, repeat: int = 12) -> tuple[float, float]:
            x = np.random.rand(batch, 28, 28, 1).astype(np.float32)
            y = np.random.randint(0, 10, batch)
            for _ in range(3):
                self._grads(x, y)
            return _timed(lambda: [g.numpy() for g in self._grads(x, y)], repeat)

        def gradients_out(self, repeat: int = 12) -> float:
            import ray

            return _timed(lambda: ray.put(list(self.weights)), repeat)[0]

        def parameters_in(self, ref_holder: list, repeat: int = 12) -> float:
            import ray

            def pull() -> None:
                for variable, value in zip(self.model.trainable_variables, ray.get(ref_holder[0])):
                    variable.assign(value)

            return _timed(pull, repeat)[0]

        def put_version(self):
            import ray

            return [ray.put(list(self.weights))]

        def take_push(self, arrays: list) -> None:
            total = getattr(self, "_total", None) or [np.zeros_like(a) for a in arrays]
            for t, a in zip(total, arrays):
                np.add(t, a, out=t)
            self._total = total

        def apply(self, repeat: int = 12) -> float:
            # As a shard applies (`apply_all`), numpy gradients in.
            tf = self.tf
            grads = list(self.weights)

            def once() -> None:
                self.optimizer.apply_all(
                    tf, self.variables, self.slots, grads, tf.constant(1e-3), tf.constant(1.0)
                )

            once()
            return _timed(once, repeat)[0]

        def publish(self, repeat: int = 12) -> float:
            import ray

            values = [v.numpy() for v in self.variables]
            return _timed(lambda: ray.put(values), repeat)[0]

        def nothing(self) -> None:
            return None

        def fetch(self, holder: list) -> float:
            import ray

            started = time.perf_counter()
            ray.get(holder[0])
            return time.perf_counter() - started

        def node(self) -> str:
            import ray

            return ray.get_runtime_context().get_node_id()

    return Probe


def measure_workload(workload: str, repeat: int) -> dict:
    import ray

    probe_cls = _probe_class()
    worker, shard = probe_cls.remote(workload), probe_cls.remote(workload)
    params = ray.get(worker.params.remote())
    nbytes = 4 * params
    compute = {b: ray.get(worker.compute.remote(b, repeat)) for b in BATCHES[workload]}
    # Two processes computing at once, as two workers on one machine do (the middle batch).
    side_by_side = BATCHES[workload][1]
    together = ray.get([p.compute.remote(side_by_side, repeat) for p in (worker, shard)])
    out_s = ray.get(worker.gradients_out.remote(repeat))
    version = ray.get(shard.put_version.remote())
    in_s = ray.get(worker.parameters_in.remote(version, repeat))
    # A push is one object (a worker's gradients, serialized together), put beforehand: the
    # worker's side is `gradients_out`. Resolved and summed by the shard, less a call's round trip.
    pushed = ray.put(ray.get(ray.get(shard.put_version.remote())[0]))
    ray.get([shard.nothing.remote(), shard.take_push.remote(pushed)])  # first calls: set-up
    call_s = _timed(lambda: ray.get(shard.nothing.remote()), repeat * 4)[0]
    push_s = _paired_difference(
        lambda: ray.get(shard.take_push.remote(pushed)), lambda: ray.get(shard.nothing.remote()), repeat * 4
    )
    apply_s = ray.get(shard.apply.remote(repeat))
    publish_s = ray.get(shard.publish.remote(repeat))
    return {
        "params": params,
        "compute": {str(b): {"wall_s": w, "cpu_s": c} for b, (w, c) in compute.items()},
        "compute_side_by_side": {
            "batch": side_by_side,
            "wall_s": statistics.median(wall for wall, _ in together),
            "alone_wall_s": compute[side_by_side][0],
        },
        "gradients_out_s": out_s,
        "parameters_in_s": in_s,
        "call_s": call_s,
        "push_s": max(push_s, 0.0),
        "apply_s": apply_s,
        "publish_s": publish_s,
        "bytes": nbytes,
    }


def measure_store_object(calls: int = 200) -> dict:
    """What an object through the object store costs beyond its bytes: an actor echoing an array
    just under Ray's inline limit (sent inside the call and its reply) against one just over it
    (both through the store); half the difference is one object's latency, and the raylet's CPU in
    the second, per object, its share of the machine's time."""
    import psutil
    import ray

    from towerflow.runtime.cost_model import DEFAULT_COSTS

    @ray.remote(num_cpus=1)
    class Echo:
        def pid(self) -> int:
            return os.getpid()

        def echo(self, array: np.ndarray) -> np.ndarray:
            return array

    echo = Echo.remote()
    raylet = psutil.Process(ray.get(echo.pid.remote())).parent()  # the raylet starts its workers
    if raylet is None or "raylet" not in raylet.name():
        raise RuntimeError(f"the echo actor's parent is {raylet and raylet.name()!r}, not Ray's raylet")

    def round_trips(nbytes: int) -> tuple[float, float]:
        array = np.ones(nbytes // 4, np.float32)
        for _ in range(20):
            ray.get(echo.echo.remote(array))
        before, walls = raylet.cpu_times(), []
        for _ in range(calls):
            started = time.perf_counter()
            ray.get(echo.echo.remote(array))
            walls.append(time.perf_counter() - started)
        after = raylet.cpu_times()
        return statistics.median(walls), (after.user + after.system - before.user - before.system) / calls

    limit = DEFAULT_COSTS.inline_bytes
    inline_s, inline_cpu_s = round_trips(int(0.9 * limit))
    stored_s, stored_cpu_s = round_trips(int(1.1 * limit))
    return {
        "inline_bytes": limit,
        "inline_round_trip_s": inline_s,
        "stored_round_trip_s": stored_s,
        "object_s": max(0.0, (stored_s - inline_s) / 2),  # the argument's and the reply's
        "object_cpu_s": max(0.0, (stored_cpu_s - inline_cpu_s) / 2),
    }


def measure_across_nodes(nbytes: int, repeat: int = 5) -> dict:
    """An object of `nbytes` fetched by an actor on another node (each node its own object store)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"a": 1}})
    cluster.add_node(num_cpus=1, resources={"b": 1})
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        probe_cls = _probe_class()
        here = probe_cls.options(resources={"a": 1}, num_cpus=0).remote("mlp")
        there = probe_cls.options(resources={"b": 1}, num_cpus=0).remote("mlp")
        assert ray.get(here.node.remote()) != ray.get(there.node.remote())
        fetches = []
        for _ in range(repeat):
            holder = [ray.put(np.random.rand(nbytes // 8))]  # new each time: never cached there
            fetches.append(ray.get(there.fetch.remote(holder)))
            del holder
        local = []
        for _ in range(repeat):
            holder = [ray.put(np.random.rand(nbytes // 8))]
            local.append(ray.get(here.fetch.remote(holder)))
        seconds = statistics.median(fetches)
        return {
            "bytes": nbytes,
            "across_s": seconds,
            "within_s": statistics.median(local),
            "link_bytes_per_s": nbytes / seconds,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def measure(args: argparse.Namespace) -> dict:
    from towerflow.runtime.cluster import keep_embedded_ray_local

    keep_embedded_ray_local()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        found = {w: measure_workload(w, args.repeat) for w in ("lenet", "mlp")}
        found["store_object"] = measure_store_object()
    finally:
        ray.shutdown()
    # Another process: Ray reads the single-machine switch (set above) at import, and it refuses
    # a second node.
    env = {k: v for k, v in os.environ.items() if k != SINGLE_MACHINE_SWITCH}
    command = [sys.executable, __file__, "across", f"--bytes={found['lenet']['bytes']}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the cross-node measurement failed:\n{done.stderr[-3000:]}")
    found["across_nodes"] = json.loads(done.stdout.strip().splitlines()[-1])
    if not args.no_overhead:
        found["overhead"] = {mode: measure_overhead(mode) for mode in ("sync", "async")}
    return found


def measure_overhead(mode: str, workers: int = 2) -> dict:
    """A towerflow run of a 7,850-parameter model (benchmarks/tiny_model.py): compute and transfers
    next to nothing, so its step is the platform's own time per global batch, and the CPU each
    kind of process used in it is the platform's own CPU."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "peers" / "peer_towerflow.py"),
            "--workload=tiny",
        ]
        command += [f"--workers={workers}", f"--mode={mode}", "--warmup=20", "--steps=100", f"--out={out}"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the overhead run ({mode}) failed:\n{done.stderr[-3000:]}")
    from peers.workloads import read_report

    reported = read_report(done.stdout)
    return {
        "workers": workers,
        "seconds_per_batch": reported["global_batch"] / reported["rate"],
        "params": 7850,
        # CPU seconds per global batch of the workers, the shards and the rest, and the cores the
        # rest (Ray's own processes, the driver, the data pipeline) kept busy
        "cpu_per_batch": reported["cpu_per_batch"],
        "other_cores": reported["other_cores"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--repeat", type=int, default=12)
    m.add_argument(
        "--no-overhead",
        action="store_true",
        help="leave out the tiny model's runs (bench.py times them in its rounds)",
    )
    across = sub.add_parser("across", help="(internal) the cross-node fetch, in a process of its own")
    across.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "across":
        print(json.dumps(measure_across_nodes(args.bytes)))
        return
    if args.command == "measure":
        found = measure(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=1))
        print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
