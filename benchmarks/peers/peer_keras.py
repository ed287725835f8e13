"""Single-process Keras `model.fit` over tf.data: the limit of one machine, the ratio's denominator.

Keras 3, the same architecture and optimizer as the others, the whole global batch in one process.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from workloads import Snapshots, StepTimes, TrainClock, build, report, runner_args, tf_dataset  # noqa: E402


def main() -> None:
    args = runner_args()
    clock = TrainClock()
    import keras

    spec = args.spec
    keras.utils.set_random_seed(0)
    model = build(args.workload, keras)
    model.compile(
        optimizer=keras.optimizers.Adam(spec.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    times = StepTimes(clock, args.warmup, args.steps, spec.global_batch)
    snaps = Snapshots(args.out, args.snapshot_every, clock)

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None) -> None:
            clock.start()

        def on_train_batch_end(self, batch, logs=None) -> None:
            step = batch + 1
            times.record(step, (logs or {}).get("loss"))
            if snaps.due(step):
                snaps.save(step, model.get_weights())

    total = args.warmup + args.steps
    data = tf_dataset(args.data, "train", spec.global_batch)
    model.fit(data, steps_per_epoch=total, epochs=1, verbose=0, shuffle=False, callbacks=[Timer()])
    report("keras", args, times, snaps, notes=[f"jit_compile={model.jit_compile}"]).emit()


if __name__ == "__main__":
    main()
