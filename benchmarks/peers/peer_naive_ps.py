"""The parameter server a user could write in an afternoon on Ray: the baseline towerflow must beat.

The pattern of Ray's own parameter-server example: one PS actor holding the whole model and its
Adam state, worker actors computing gradients on in-memory batches, and the driver relaying object
references step by step (weights -> every worker's gradients -> the PS's apply -> new weights).
Synchronous: each update averages one gradient per worker. No data pipeline (each worker holds its
share of the examples as numpy arrays), no sharding, no overlap beyond Ray's own.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from towerflow.runtime.cluster import keep_embedded_ray_local  # noqa: E402

keep_embedded_ray_local()  # before Ray's import: it reads the switches then

import ray  # noqa: E402
from workloads import (  # noqa: E402
    ROOT,
    Snapshots,
    StepTimes,
    TrainClock,
    build,
    numpy_batches,
    report,
    runner_args,
)

PEERS = str(ROOT / "benchmarks" / "peers")


@ray.remote(num_cpus=0.5)
class ParameterServer:
    def __init__(self, workload: str, learning_rate: float) -> None:
        import keras

        keras.utils.set_random_seed(0)
        self.model = build(workload, keras)
        self.optimizer = keras.optimizers.Adam(learning_rate)
        self.optimizer.build(self.model.trainable_variables)

    def apply(self, *gradients):
        mean = [sum(parts) / len(parts) for parts in zip(*gradients)]
        self.optimizer.apply_gradients(zip(mean, self.model.trainable_variables))
        return self.model.get_weights()

    def weights(self):
        return self.model.get_weights()


@ray.remote(num_cpus=1)
class Worker:
    def __init__(self, workload: str, data: str, batch: int, index: int, workers: int, steps: int) -> None:
        import keras
        import tensorflow as tf

        self.model = build(workload, keras)
        limit = (index + 1) * batch * steps  # this worker's slice of the first examples
        self.batches = list(numpy_batches(data, "train", batch, limit))[index * steps :]
        self.at = 0
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function(reduce_retracing=True)
        def gradients(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, self.model(x, training=True))
            return tape.gradient(loss, self.model.trainable_variables), loss

        self._gradients = gradients

    @ray.method(num_returns=2)
    def compute(self, weights):
        self.model.set_weights(weights)
        x, y = self.batches[self.at % len(self.batches)]
        self.at += 1
        grads, loss = self._gradients(x, y)
        return [g.numpy() for g in grads], float(loss)


def main() -> None:
    args = runner_args()
    clock = TrainClock()
    spec, total = args.spec, args.warmup + args.steps
    ray.init(
        num_cpus=args.workers + 1,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": PEERS, "TF_CPP_MIN_LOG_LEVEL": "2"}},
    )
    try:
        batch = spec.global_batch // args.workers
        ps = ParameterServer.remote(args.workload, spec.learning_rate)
        workers = [
            Worker.remote(args.workload, str(args.data), batch, i, args.workers, total)
            for i in range(args.workers)
        ]
        first = ps.weights.remote()
        ray.get([w.compute.remote(first)[1] for w in workers])  # every actor up and its step traced
        times = StepTimes(clock, args.warmup, args.steps, spec.global_batch)
        snaps = Snapshots(args.out, args.snapshot_every, clock)
        clock.start()
        weights = ps.weights.remote()
        pending = None  # the previous step's (weights, loss): waited for one step behind
        for step in range(1, total + 2):
            if step <= total:
                outputs = [w.compute.remote(weights) for w in workers]
                weights = ps.apply.remote(*[grads for grads, _ in outputs])
            if pending is not None:
                done_weights, loss = pending
                ray.wait([done_weights])
                times.record(step - 1, ray.get(loss))
                if snaps.due(step - 1):
                    snaps.save(step - 1, ray.get(done_weights))
            pending = (weights, outputs[0][1]) if step <= total else None
        report("naive_ps", args, times, snaps, notes=["Ray's parameter-server example pattern"]).emit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
