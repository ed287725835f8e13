"""Supervision end to end on real Ray, TensorFlow and an MLflow store: checkpoints and resume
(also onto another number of shards), evaluation, profiles, NaN guard, stop, start delay, user hooks.

Tests whose runs have one placement, tracked or not, follow each other: a finished run's actors
wait for the next run that fits them (runtime/actor_pool.py)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from sample_hooks import RecordingHook, StopAtStepHook
from support import ONE_OF_EACH, blob_spec, mlflow_uri, sqlite_store

from towerflow.checkpoint.files import checkpoint_name
from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.checkpoint.stores import LocalCheckpointStore
from towerflow.errors import DataError, SpecError, TrainingError
from towerflow.launch import train
from towerflow.runtime.faults import FaultInjector
from towerflow.runtime.hooks import Hook
from towerflow.spec import validate_spec


def _spec(blob_data, uri: str | None, **sections):
    raw = blob_spec(
        blob_data,
        tracking={"tracking_uri": uri, "experiment": "supervision"} if uri else {},
        **sections,
    )
    raw["data"]["epochs"] = None
    raw["data"]["eval"] = {"paths": str(blob_data / "train-00000-*")}
    raw["training"] = {**raw["training"], "optimizer": {"name": "adam", "learning_rate": 0.01}}
    return validate_spec(raw)


@pytest.fixture(scope="module")
def first_run(ray_cluster, blob_data, tmp_path_factory):
    """8 steps on 2 shards (the resumes below change their number): checkpoints every 3, evaluation
    every 4, profile of steps [2, 4) on worker 0, a user hook."""
    uri = sqlite_store(tmp_path_factory.mktemp("mlflow"))
    RecordingHook.instances.clear()
    spec = _spec(
        blob_data,
        uri,
        cluster={"workers": 1, "ps": 2},
        training={"max_steps": 8},
        supervision={
            "log_every_steps": 1,
            "checkpoint": {"every_steps": 3},
            "eval": {"every_steps": 4, "metrics": ["loss", "accuracy", "precision", "recall", "auc"]},
            "profile": {"start_step": 2, "stop_step": 4, "workers": [0]},
            "hooks": [{"ref": "sample_hooks:RecordingHook", "params": {"label": "user"}}],
        },
    )
    result = train(spec)
    return spec, uri, result, RecordingHook.instances[-1]


def test_checkpoints_every_n_steps_and_at_the_end(first_run):
    spec, uri, result, _ = first_run
    store = MlflowCheckpointStore(MlflowClient(uri), result.run_id)
    assert [step for step, _ in store.list()] == [3, 6, 8]
    final = store.load(8)
    assert final.global_step == 8 and final.optimizer == "adam" and set(final.slots) == {"m", "v"}
    for name, value in zip(final.names, result.parameters):
        np.testing.assert_array_equal(final.variables[name], value)
    assert final.data_position["examples_seen"] > 0
    # Each shard wrote its own part; meta.json says which rows of which variable each part holds.
    assert [part.name for part in store.open(8).parts] == ["shard-00000", "shard-00001"]


def test_evaluation_metrics_are_logged_at_the_evaluated_step(first_run):
    _, uri, result, hook = first_run
    client = MlflowClient(uri)
    history = client.get_metric_history(result.run_id, "eval_accuracy")
    assert history and history[-1].step == 8  # the final evaluation
    assert all(0.0 <= m.value <= 1.0 for m in history)
    run = client.get_run(result.run_id)
    for name in ("eval_loss", "eval_precision", "eval_recall", "eval_auc"):
        assert name in run.data.metrics
    assert run.data.metrics["eval_examples"] == 256  # the whole eval file, every time
    seen = [step for step, metrics in hook.metrics if "eval_loss" in metrics]
    assert seen == [m.step for m in client.get_metric_history(result.run_id, "eval_loss")]


def test_profiles_of_the_window_are_logged(first_run, tmp_path):
    _, uri, result, _ = first_run
    client = MlflowClient(uri)
    files = []
    pending = ["profiles"]
    while pending:
        for entry in client.list_artifacts(result.run_id, pending.pop()):
            (pending if entry.is_dir else files).append(entry.path)
    assert "profiles/ray_timeline.json" in files
    traces = [
        f for f in files if f.startswith("profiles/worker-0/plugins/profile/") and f.endswith(".xplane.pb")
    ]
    assert (
        traces
    )  # the layout TensorBoard's profile view reads: <logdir>/plugins/profile/<run>/<host>.xplane.pb
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(
        Path(client.download_artifacts(result.run_id, traces[0], str(tmp_path))).read_bytes()
    )
    host = [plane for plane in space.planes if plane.name == "/host:CPU"]
    assert host and sum(len(line.events) for line in host[0].lines) > 0  # the traced steps' ops


def test_user_hook_from_import_string_sees_the_lifecycle(first_run):
    _, _, result, hook = first_run
    assert hook.label == "user"
    assert hook.calls == ["begin", "after_create_session", "before_run", "after_run", "end:FINISHED"]
    assert [e.global_step for e in hook.events] == list(range(1, 9))


def test_resume_onto_more_shards_restores_exactly(first_run, blob_data):
    spec, uri, result, _ = first_run
    store = MlflowCheckpointStore(MlflowClient(uri), result.run_id)
    written = dict(store.list())
    resumed = train(
        spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"ps": 3})}), resume=result.run_id
    )
    assert resumed.run_id == result.run_id and resumed.global_step == 8
    assert {s["loaded_from"] for s in resumed.shards} == {"values from the driver"}  # re-cut: 2 parts onto 3
    for before, after in zip(result.parameters, resumed.parameters):
        np.testing.assert_array_equal(before, after)
    # Resumed at its last step, the run saved nothing over the checkpoint it resumed from (a
    # failure while rewriting it in place would have lost the newest good one).
    after = MlflowCheckpointStore(MlflowClient(uri), result.run_id)  # a store reads each meta once
    assert dict(after.list()) == written
    again = after.load(8)
    for name, value in zip(again.names, result.parameters):
        np.testing.assert_array_equal(again.variables[name], value)


def test_resume_onto_fewer_shards_continues_the_same_run(first_run, tmp_path):
    spec, uri, result, _ = first_run
    store = MlflowCheckpointStore(MlflowClient(uri), result.run_id)
    # What a driver killed while writing step 10's checkpoint leaves: a part, no meta.json.
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "state.index").write_bytes(b"cut short")
    store.writer(10).write_part("shard-00000", str(tmp_path / "part"))
    more = spec.model_copy(
        update={
            "cluster": spec.cluster.model_copy(update={"ps": 1}),
            "training": spec.training.model_copy(update={"max_steps": 11}),
        }
    )
    resumed = train(more, resume=result.run_id)
    assert resumed.global_step == 11
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["towerflow.resumed_from_step"] == "8"
    assert run.data.tags["towerflow.resumed_from"] == "its checkpoint of step 8"
    assert not any(k.startswith("towerflow.fault.") for k in run.data.tags)  # it was not left RUNNING
    steps = [m.step for m in client.get_metric_history(result.run_id, "loss")]
    assert steps[:8] == list(range(1, 9)) and steps[-1] == 11 and all(s > 8 for s in steps[8:])
    assert [s for s, _ in store.list()][-1] == 11
    # The resumed run went on from step 8, and its save at 11 removed the unfinished 10.
    left = [Path(e.path).name for e in client.list_artifacts(result.run_id, "checkpoints")]
    assert left == [checkpoint_name(step) for step, _ in store.list()], left


def test_a_hook_failing_at_the_end_fails_the_run_and_keeps_its_checkpoints(ray_cluster, blob_data, tmp_path):
    uri = sqlite_store(tmp_path)
    spec = _spec(
        blob_data,
        uri,
        cluster=ONE_OF_EACH,
        training={"max_steps": 4},
        supervision={"checkpoint": {"every_steps": 2}, "hooks": ["sample_hooks:FailsAtEndHook"]},
    )
    with pytest.raises(TrainingError, match="hook FailsAtEndHook failed at its end: the bucket refused"):
        train(spec)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("supervision").experiment_id])
    assert run.info.status == "FAILED" and "bucket refused" in run.data.tags["towerflow.error"]
    store = MlflowCheckpointStore(client, run.info.run_id)
    assert [s for s, _ in store.list()] == [2, 4]  # the final checkpoint was written before the hook failed
    assert store.load(4).global_step == 4


def test_nan_guard_fails_the_run_and_keeps_the_last_good_checkpoint(ray_cluster, blob_data, tmp_path):
    uri = sqlite_store(tmp_path)
    spec = _spec(
        blob_data,
        uri,
        cluster=ONE_OF_EACH,
        training={"max_steps": 30},
        supervision={"checkpoint": {"every_steps": 2}},
    )
    nan_from_step_5 = FaultInjector(nonfinite_loss={0: (5, None)})
    with pytest.raises(TrainingError, match="loss is nan at global step 5"):
        train(spec, faults=nan_from_step_5)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("supervision").experiment_id])
    assert run.info.status == "FAILED" and "loss is nan" in run.data.tags["towerflow.error"]
    store = MlflowCheckpointStore(client, run.info.run_id)
    assert [s for s, _ in store.list()] == [2, 4]
    assert store.load(4).all_finite()


def test_nan_guard_catches_nan_gradients_of_a_finite_loss(ray_cluster, blob_data, tmp_path):
    """The loss is finite and the gradients are NaN (sqrt(0) in the model): nothing is pushed,
    and the run fails naming the gradients, its parameters as they were."""
    spec = _spec(blob_data, None, cluster=ONE_OF_EACH, training={"max_steps": 5})
    spec.model.ref = "tests.runtime.model_fns:nan_gradients"
    with pytest.raises(TrainingError, match=r"the gradients hold NaN/inf \(loss [0-9.]+\) at global step 1"):
        train(spec, track=False, output_dir=tmp_path)


def test_nan_guard_stop_ends_the_run_cleanly(ray_cluster, blob_data, tmp_path):
    spec = _spec(
        blob_data, None, cluster=ONE_OF_EACH, training={"max_steps": 30}, supervision={"nan_guard": "stop"}
    )
    result = train(
        spec, track=False, output_dir=tmp_path, faults=FaultInjector(nonfinite_loss={0: (4, None)})
    )
    assert result.global_step == 3
    assert all(np.isfinite(p).all() for p in result.parameters)
    assert [s for s, _ in LocalCheckpointStore(tmp_path / "checkpoints").list()] == [3]


def test_stop_at_step_stops_exactly(ray_cluster, blob_data, tmp_path):
    def stopping(**stop_at_step):
        return _spec(
            blob_data,
            None,
            cluster=ONE_OF_EACH,
            training={"max_steps": 100},
            supervision={"stop_at_step": stop_at_step},
        )

    result = train(stopping(num_steps=5), track=False, output_dir=tmp_path)
    assert result.global_step == 5
    # Resumed where its stop_at_step already is, a run trains nothing and is no error (its data
    # did not end before a first step: its bound was reached).
    resumed = train(stopping(last_step=5), track=False, resume=str(tmp_path), output_dir=tmp_path)
    assert resumed.global_step == 5


class WaitForTheEnd(Hook):
    """At step 1, waits until training has ended, as the runtime's own waits in a hook do (a
    checkpoint's cut): hearing of the workers meanwhile, and holding the steps it hears of until the
    hook returns. A slow checkpoint near the end of a run does exactly this."""

    def after_run(self, context, event) -> None:
        runtime = context.session.runtime
        while event.global_step == 1 and runtime.group.running:
            runtime._backlog.extend(runtime._turn())


def test_steps_heard_while_a_hook_waits_are_reported_even_when_training_ended_meanwhile(
    ray_cluster, blob_data, tmp_path
):
    recorder = RecordingHook()
    spec = _spec(blob_data, None, cluster=ONE_OF_EACH, training={"max_steps": 6})
    result = train(spec, hooks=[WaitForTheEnd(), recorder], track=False, output_dir=tmp_path)
    assert result.global_step == 6
    assert [e.global_step for e in recorder.events] == [1, 2, 3, 4, 5, 6]  # none lost after the wait


def test_checkpoints_every_n_seconds_and_retention(ray_cluster, blob_data, tmp_path):
    spec = _spec(
        blob_data,
        None,
        cluster=ONE_OF_EACH,
        training={"max_steps": 40},
        supervision={"checkpoint": {"every_secs": 0.5, "max_to_keep": 2}},
    )
    slow = FaultInjector(step_delay_s={0: 0.1})  # about 4 s of training
    result = train(spec, track=False, output_dir=tmp_path, faults=slow)
    steps = [s for s, _ in LocalCheckpointStore(tmp_path / "checkpoints").list()]
    assert len(steps) == 2 and steps[-1] == result.global_step == 40  # the newest two kept
    assert steps[0] < 40


class _SlowChief(Hook):
    """Holds the driver once, as a slow MLflow store or a busy chief would: the shards run ahead."""

    def __init__(self, at_step: int, seconds: float) -> None:
        self.at_step, self.seconds, self.done = at_step, seconds, False

    def after_run(self, context, event) -> None:
        if event.global_step >= self.at_step and not self.done:
            self.done = True
            time.sleep(self.seconds)


def test_checkpoints_of_steps_the_shards_no_longer_hold_are_cut_at_a_later_one(
    ray_cluster, blob_data, tmp_path
):
    # A shard keeps the last few steps the checkpoint hook asked for; past them it answered with its
    # state now, and two shards at different versions failed the run ("not a consistent cut").
    spec = _spec(
        blob_data,
        None,
        cluster={"workers": 2, "ps": 2},
        training={"max_steps": 200},
        supervision={"checkpoint": {"every_steps": 1, "max_to_keep": 1000}},
    )
    result = train(spec, hooks=[_SlowChief(at_step=3, seconds=1.0)], track=False, output_dir=tmp_path)
    assert result.global_step == 200
    store = LocalCheckpointStore(tmp_path / "checkpoints")
    steps = [step for step, _ in store.list()]
    assert len(steps) < 200  # steps the shards had dropped were skipped, not saved out of order
    for step in steps:
        state = store.load(step)
        assert state.global_step == step and state.all_finite()
        # The data position belongs to the saved state: it never says more examples were trained on
        # than the state holds (a resume would skip unseen data), nor names another step.
        assert state.data_position.get("global_step", step) == step, state.data_position
        assert state.examples_seen <= step * 2 * 32


def test_worker_k_starts_after_step_k_times_delay(ray_cluster, blob_data, tmp_path):
    RecordingHook.instances.clear()
    spec = _spec(
        blob_data,
        None,
        training={"mode": "async", "max_steps": 24},
        supervision={"worker_start_delay_steps": 4, "hooks": ["sample_hooks:RecordingHook"]},
    )
    # Worker 0 is slowed so that worker 1, once it may start (and has traced its first step), gets
    # some steps in: 20 steps at 0.1 s.
    train(spec, track=False, output_dir=tmp_path, faults=FaultInjector(step_delay_s={0: 0.1}))
    events = RecordingHook.instances[-1].events
    first_by_worker_1 = min(e.global_step for e in events if 1 in e.workers)
    assert first_by_worker_1 > 4
    assert all(e.workers == [0] for e in events if e.global_step <= 4)
    assert not math.isnan(events[-1].loss)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ends_by", ["stop", "end of data"])
def test_a_worker_still_waiting_to_start_does_not_hold_the_end(ray_cluster, blob_data, tmp_path, ends_by):
    # Worker 1 may start only at step 1,000, which the run never reaches: when worker 0 is done
    # (stopped by a hook, or out of data), worker 1 must be let go instead of waiting forever.
    spec = _spec(
        blob_data,
        None,
        training={"mode": "async", "max_steps": 1000},
        supervision={"worker_start_delay_steps": 1000},
    )
    spec.data.epochs = 1 if ends_by == "end of data" else 5
    result = train(
        spec, hooks=[StopAtStepHook(3)] if ends_by == "stop" else [], track=False, output_dir=tmp_path
    )
    assert 3 <= result.global_step < 1000
    assert [w["steps"] for w in result.workers][1] == 0
    assert {s["version"] for s in result.shards} == {result.global_step}


def test_resume_goes_on_with_the_epoch_instead_of_starting_it_over(ray_cluster, blob_data, tmp_path, caplog):
    # An epoch is 16 steps of 2 workers x 32 (1,024 examples in 4 files of 256). Stopped at step 12,
    # the resumed run reads only the last file: 4 more steps to the end of the epoch, not 16.
    run_dir = tmp_path / "run"
    two_workers = {"workers": 2, "ps": 1}  # the data position is the workers' together

    def spec(max_steps):
        return validate_spec(
            blob_spec(blob_data, cluster=two_workers, data={"epochs": 1}, training={"max_steps": max_steps})
        )

    hooks = [RecordingHook(), RecordingHook()]
    first = train(spec(12), hooks=hooks[:1], track=False, output_dir=run_dir)
    assert first.global_step == 12 and first.examples_seen == 768
    longer = spec(100)
    with caplog.at_level(logging.INFO, logger="towerflow"):
        resumed = train(longer, hooks=hooks[1:], track=False, resume=str(run_dir), output_dir=run_dir)
    assert "data resumes in epoch 1 of 1, after 3 file(s) of it (768 of 768" in caplog.text
    assert resumed.global_step == 16 and resumed.examples_seen == 1024
    assert resumed.shards[0]["loaded_from"] == "shard-00000 of step 12"  # the shard read its own part
    # Both runs knew from the files' counts that the data ends at step 16 (the progress bar's total).
    assert [hook.data_steps for hook in hooks] == [16, 16]
    assert LocalCheckpointStore(run_dir / "checkpoints").load(16).data_position["examples_seen"] == 1024
    with pytest.raises(DataError, match="nothing left to read"):
        train(longer, track=False, resume=str(run_dir), output_dir=run_dir)


def test_resume_of_an_unknown_run_is_a_clear_error(first_run):
    spec, _, _, _ = first_run
    with pytest.raises(SpecError, match="no such run"):
        train(spec, resume="0123456789abcdef0123456789abcdef")


def test_export_on_demand_uses_the_latest_checkpoint(first_run, blob_data):
    import mlflow

    from towerflow.tracking.export import build_trained_model, export_run

    spec, uri, result, _ = first_run
    exported = export_run(result.run_id, uri)
    store = MlflowCheckpointStore(MlflowClient(uri), result.run_id)
    latest = store.load(store.list()[-1][0])
    x = np.random.default_rng(3).normal(size=(5, 8)).astype(np.float32)
    expected = np.asarray(build_trained_model(spec, [latest.variables[n] for n in latest.names])(x))
    with mlflow_uri(uri):
        served = mlflow.pyfunc.load_model(exported.model_uri)
        np.testing.assert_allclose(np.asarray(served.predict(x)), expected, atol=1e-5)


def test_a_user_hook_with_a_misspelt_parameter_is_named_with_those_it_takes():
    from towerflow.spec.supervision_schema import HookRef
    from towerflow.supervision.factory import load_user_hooks

    entry = HookRef(ref="sample_hooks:StopAtStepHook", params={"stp": 3})
    with pytest.raises(
        SpecError, match=r"supervision.hooks\[1\]: got an unexpected keyword argument 'stp'.*takes: step"
    ):
        load_user_hooks(["sample_hooks:RecordingHook", entry])


def test_an_evaluation_due_while_one_runs_is_left_out_and_the_next_waits_its_turn(blob_data):
    """Evaluations every 10 steps, one taking longer than 10: the one due meanwhile is left out,
    and the next starts at its own due step, not at once when the slow one returns (before, the
    evaluator ran back to back for the rest of the run)."""
    from concurrent.futures import Future

    from towerflow.runtime.hooks import RunContext, SessionInfo, StepEvent
    from towerflow.supervision.evaluation import EvalHook

    class Evaluations:  # the runtime's side: each evaluation a Future this test ends
        def __init__(self) -> None:
            self.started_at: list[int] = []
            self.step = 0

        def evaluate(self, *args) -> Future:
            self.started_at.append(self.step)
            return Future()

    runtime = Evaluations()
    spec = _spec(blob_data, None, cluster=ONE_OF_EACH, training={"max_steps": 100})
    session = SessionInfo(spec=spec, num_workers=1, num_shards=1, runtime=runtime)
    hook = EvalHook(10, ["loss"], batch_size=32)
    hook.begin(session)
    for step in range(1, 36):
        runtime.step = step
        hook.after_run(
            RunContext(session), StepEvent(step, 0.5, {}, 32, 32 * step, float(step), 100.0, {}, [0])
        )
        if step == 23:  # the evaluation of step 10 returns
            hook._in_flight.set_result((10, {"loss": 0.5}))
    assert runtime.started_at == [10, 30]
