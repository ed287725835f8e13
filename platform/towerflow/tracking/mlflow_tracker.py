"""MLflowTracker: one MLflow run per job; the flattened spec as params, step metrics as metrics.

All logging happens here, in the driver: SQLite-backed stores do not like many writers, so the
workers' figures reach MLflow only through the step events. Metrics are buffered and handed every
few seconds (and at the end) to a thread that writes them with `log_batch` (shipper.py), so neither
the hot path nor the driver's loop waits for the server, and a server away for a while loses
nothing: the run's end waits for it (END_WAIT_S at most).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

from towerflow.errors import RunEndedWhileAway, TrainingError
from towerflow.runtime.hooks import FaultEvent, Hook, RunContext, RunOutcome, SessionInfo, StepEvent
from towerflow.runtime.protocol import protocol_for
from towerflow.spec import flatten_spec
from towerflow.tracking.run_metadata import run_params, run_tags
from towerflow.tracking.step_metrics import StepWindow
from towerflow.tracking.store import (
    ensure_experiment,
    run_store_uri,
    run_unreadable,
    shown_address,
    without_credentials,
)

log = logging.getLogger(__name__)

SPEC_ARTIFACT = "spec.yaml"
# The driver that has the run now (a new mark per driver): a driver woken after its run ended
# without it ends the MLflow run only where no other driver has marked it since.
DRIVER_TAG = "towerflow.driver"
END_WAIT_S = 600.0  # how long a run's end waits for a tracking server that does not answer


class MLflowTracker(Hook):
    """One MLflow run per job. `parent_run_id` makes it a child run (as `towerflow compare` does).

    When the spec asks for it (`export.saved_model`), a FINISHED run also exports the trained model
    (towerflow.tracking.export) before the run is closed; if that fails, the run ends FAILED and
    `end_error` holds the error, for the caller to raise.
    """

    def __init__(
        self,
        spec: Any,
        *,
        tracking_uri: str | None = None,
        flush_every_s: float = 2.0,
        resume_run_id: str | None = None,
        parent_run_id: str | None = None,
    ) -> None:
        self.spec = spec
        self.tracking_uri = run_store_uri(tracking_uri or spec.tracking.tracking_uri)
        self.flush_every_s = flush_every_s
        self.log_every_steps = spec.supervision.log_every_steps
        self.resume_run_id = resume_run_id
        self.parent_run_id = parent_run_id
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.exported = None  # towerflow.tracking.export.ExportedModel, after a successful export
        self.end_error: Exception | None = None
        self._client = None
        self._buffer: list[Any] = []
        self._last_flush = 0.0
        self._last_logged_step = 0
        self._logged_before = 0  # a resumed run's last logged step, as its earlier driver left it
        self._window = StepWindow(staleness=not protocol_for(spec.training.mode).lockstep)
        self._system = None  # towerflow.tracking.system_metrics.ClusterSystemMetrics while running
        self._faults = 0  # fault tags written
        self._shipper = None  # towerflow.tracking.shipper.MetricShipper, once the run is open
        # This driver's mark on the run (DRIVER_TAG): a driver that resumes the run sets its own.
        self._driver = uuid.uuid4().hex

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def restore_state(self, required: bool = True):
        """The latest checkpoint of the run being resumed (a StoredCheckpoint: its parts are read
        by the shards); where it has none, an error, or None when not `required`."""
        from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
        from towerflow.checkpoint.resume import latest_checkpoint
        from towerflow.checkpoint.stores import latest_step

        run = self._resumable_run()
        store = MlflowCheckpointStore(self.client, run.info.run_id)
        if not required and latest_step(store) is None:
            return None
        return latest_checkpoint(store, f"run {run.info.run_id}")

    def begin(self, session: SessionInfo) -> None:
        try:
            self._open(session)
        except BaseException as exc:
            self._end_opened_run(exc)
            raise

    def _end_opened_run(self, exc: BaseException) -> None:
        """A begin that failed once the run was open (its spec artifact refused by the artifact
        store, say): the driver ends only the hooks that began, so the run is ended here, FAILED
        (KILLED by a stop) with the error, not left RUNNING."""
        if self.run_id is None:
            return
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        with contextlib.suppress(Exception):  # the server that failed the begin may refuse this too
            self._tag_error(exc)
            self.client.set_terminated(self.run_id, status=status)

    def _open(self, session: SessionInfo) -> None:
        import mlflow

        if self.resume_run_id:
            self._reopen(session)
            return
        spec = self.spec
        self._client = self.client
        self.experiment_id = ensure_experiment(self._client, spec.experiment, self.tracking_uri)
        tags = {
            **run_tags(spec.training.mode),
            "towerflow.job": spec.name,
            DRIVER_TAG: self._driver,
            "mlflow.runName": spec.tracking.run_name or f"{spec.name}-{spec.training.mode}",
        }
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        run = self._client.create_run(self.experiment_id, tags=tags)
        self.run_id = run.info.run_id
        session.tags["run_id"] = self.run_id
        session.tags["experiment_id"] = self.experiment_id
        session.tags["tracking_uri"] = self.tracking_uri
        params = flatten_spec(spec)
        params["cluster.ps_shards"] = str(session.num_shards)
        params.update(run_params())
        # The whole spec, loadable again (towerflow.tracking.export.load_run_spec): export and resume need it.
        self._client.log_dict(self.run_id, spec.model_dump(mode="json"), SPEC_ARTIFACT)
        self._log_params([mlflow.entities.Param(k, v[:6000]) for k, v in sorted(params.items())])

    def _resumable_run(self):
        from mlflow.exceptions import MlflowException

        from towerflow.errors import SpecError

        try:
            run = self.client.get_run(self.resume_run_id)
        except MlflowException as exc:
            raise run_unreadable(exc, self.tracking_uri, f"--resume {self.resume_run_id}") from None
        job = run.data.tags.get("towerflow.job")
        if job != self.spec.name:
            raise SpecError(
                f"--resume {self.resume_run_id}: that run is of job {job!r}, not {self.spec.name!r}"
            )
        return run

    def _reopen(self, session: SessionInfo) -> None:
        """Continue the same run: it goes back to RUNNING; params stay as first logged."""
        run = self._resumable_run()
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        self.client.update_run(self.run_id, status="RUNNING")
        self.client.set_tag(self.run_id, DRIVER_TAG, self._driver)
        self.client.set_tag(self.run_id, "towerflow.resumed_from_step", str(session.start_step))
        if session.resumed_from:
            self.client.set_tag(self.run_id, "towerflow.resumed_from", session.resumed_from)
        self._last_logged_step = session.start_step
        session.tags.update(
            run_id=self.run_id, experiment_id=self.experiment_id, tracking_uri=self.tracking_uri
        )
        # The earlier drivers' fault tags stay: this one's are numbered after them.
        self._faults = sum(1 for key in run.data.tags if key.startswith("towerflow.fault."))
        self._logged_before = int(run.data.metrics.get("global_step", 0))
        if run.info.status == "RUNNING":  # a driver that ends its run marks it FINISHED, FAILED or KILLED
            went_on = (
                f"a new driver went on from {session.resumed_from}"
                if session.resumed_from
                else "a new driver started it over from step 0 (it had no checkpoint or live shards to resume from)"
            )
            # Where its metrics end: steps past it were trained, and not logged, by no driver or a
            # dying one (a lost driver's kept workers train on for a moment, runtime/run_keeper.py).
            last = run.data.metrics.get("global_step")
            what = "the driver lost (the run was left RUNNING"
            what += f", its metrics ending at step {last:g})" if last is not None else ")"
            self.on_fault(FaultEvent(int(last) if last is not None else session.start_step, what, went_on))

    def after_create_session(self, session: SessionInfo) -> None:
        from mlflow.entities import Param

        if self.spec.tracking.system_metrics:
            self._start_system_metrics()
        sizes = [sum(session.pieces[i].nbytes for i in shard) for shard in session.shard_assignment]
        params = [
            Param("model.trainable_variables", str(len(session.variables))),
            Param("model.parameters_bytes", str(sum(v.nbytes for v in session.variables))),
            Param("cluster.shard_bytes", ",".join(str(s) for s in sizes)),
        ]
        if self.resume_run_id:  # params stay as first logged (a driver killed as it started logged none)
            logged = self.client.get_run(self.run_id).data.params
            params = [param for param in params if param.key not in logged]
        self._log_params(params)

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        step = event.global_step
        self._window.add(event)
        if self._system is not None:  # on its own clock, whatever log_every_steps is
            self._buffer.extend(self._system.poll())
        if step - self._last_logged_step >= self.log_every_steps or step == 1 or event.nonfinite:
            self._log_step(event)
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def on_past_steps(self, events: list[StepEvent]) -> None:
        """A lost driver's last steps, from the workers this driver took over: those past what it
        logged, at the run's cadence (`log_every_steps`), without elapsed_s (its clock is not known)."""
        from mlflow.entities import Metric

        now, logged = int(time.time() * 1000), self._logged_before
        for event in events:
            if event.global_step - logged >= self.log_every_steps:
                logged = event.global_step
                self._buffer.extend(Metric(k, float(v), now, logged) for k, v in _step_values(event).items())
        if logged > self._logged_before:  # the next step logged keeps the cadence
            self._last_logged_step = logged

    def _log_step(self, event: StepEvent) -> None:
        from mlflow.entities import Metric

        step = self._last_logged_step = event.global_step
        now = int(time.time() * 1000)
        values = {**_step_values(event), "elapsed_s": event.elapsed_s, **self._window.metrics()}
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in values.items())

    def on_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items())

    def on_fault(self, event: FaultEvent) -> None:
        """A tag per lost actor (what, when, what was done); the counts arrive as metrics."""
        if self._client is None or self.run_id is None:
            return
        from mlflow.entities import RunTag

        self._faults += 1
        tag = RunTag(f"towerflow.fault.{self._faults:03d}", f"{event.what}: {event.action}"[:5000])
        self._ship().put(tags=[tag])

    def end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        if self._client is None or self.run_id is None:
            return
        try:
            self._end(session, outcome)
        except KeyboardInterrupt:
            # Stopped again while the run ended (its metrics drained, its model exported): the
            # run ends KILLED at once, not RUNNING for ever.
            with contextlib.suppress(Exception):
                self.client.set_terminated(self.run_id, status="KILLED")
            raise

    def _end(self, session: SessionInfo, outcome: RunOutcome) -> None:
        if self._system is not None:
            self._buffer.extend(self._system.stop())
            self._system = None
        if outcome.taken_over and not self._left_to_this_driver(outcome):
            # The run is another driver's, which logs its steps and ends it: nothing of this
            # driver's is sent from now on (a backlog held while it was cut off, say).
            self._buffer = []
            if self._shipper is not None:
                self._shipper.close(discard=True)
                self._shipper = None
            return
        last = session.runtime.last_event() if session.runtime is not None else None
        if last is not None and last.global_step > self._last_logged_step:
            self._log_step(last)  # the final step is always logged
        if outcome.status == "FINISHED" and outcome.global_step > self._last_logged_step:
            # Async shards that drifted apart ended at the furthest's step, which the steps heard
            # (shard 0's count) fell short of: the run's metrics end where its result does.
            self.on_metrics({"global_step": outcome.global_step}, outcome.global_step)
        self._hand_over()
        refusal = self._wait_for_the_server()
        status, error = ("FAILED" if outcome.taken_over else outcome.status), outcome.error
        if refusal is not None and error is None:
            status, error = "FAILED", refusal
            self.end_error = refusal
        if status == "FINISHED" and self.spec.export.saved_model:
            try:
                self._export(outcome.result)
            except Exception as exc:
                status, error = "FAILED", exc
                self.end_error = exc
        if error is not None:
            self._tag_error(error)
        self._client.set_terminated(self.run_id, status=status)

    def _left_to_this_driver(self, outcome: RunOutcome) -> bool:
        """Whether a run this driver stopped on as not its own (`outcome.taken_over`) is its to end
        all the same: the run's control point ended while the driver was away (RunEndedWhileAway),
        and no driver has reopened the MLflow run since, which is still RUNNING with this one's
        mark. Else the run is left as it is (another driver's, or ended by one)."""
        if not isinstance(outcome.error, RunEndedWhileAway):
            return False
        try:
            run = self.client.get_run(self.run_id)
        except Exception as exc:  # unanswered: left as it is, as a taken-over run is
            log.warning("run %s: could not read whether another driver has it: %s", self.run_id, exc)
            return False
        return run.info.status == "RUNNING" and run.data.tags.get(DRIVER_TAG) == self._driver

    def _tag_error(self, error: BaseException) -> None:
        """The run's error tag: the error's message (its type where it has none), cut to MLflow's size."""
        message = without_credentials(str(error).strip()) or type(error).__name__
        self.client.set_tag(self.run_id, "towerflow.error", message[:5000])

    def _export(self, result: Any) -> None:
        from towerflow.tracking.export import ExportError, export_model

        if result is None or result.parameters is None:
            raise ExportError("export.saved_model: the run returned no trained parameters to export")
        self.exported = export_model(
            self.spec,
            result.parameters,
            self.run_id,
            tracking_uri=self.tracking_uri,
            model_state=result.model_state,
        )
        self._client.set_tag(self.run_id, "towerflow.model_uri", self.exported.model_uri)
        if self.exported.registry_uri:
            self._client.set_tag(self.run_id, "towerflow.registered_model", self.exported.registry_uri)

    def _start_system_metrics(self) -> None:
        import ray

        from towerflow.tracking.system_metrics import ClusterSystemMetrics, next_sample_steps

        if not ray.is_initialized():
            return
        system = ClusterSystemMetrics(self.spec.tracking.system_metrics_interval_s)
        try:
            system.start(next_sample_steps(self.client, self.run_id) if self.resume_run_id else None)
        except Exception as exc:  # monitoring must never stop training
            log.warning("system metrics are off for this run: %s", exc)
            return
        self._system = system

    def flush(self) -> None:
        """Hand the buffered metrics to the shipper's thread (sent in order, retried until taken)."""
        self._last_flush = time.monotonic()
        self._hand_over()
        refusal = self._shipper.take_refusal() if self._shipper is not None else None
        if refusal is not None:
            raise refusal  # the store refused a batch: as a write from this loop would

    def _hand_over(self) -> None:
        """The buffered metrics to the shipper (started with the first of them)."""
        if self._buffer:
            metrics, self._buffer = self._buffer, []
            self._ship().put(metrics)

    def _ship(self):
        if self._shipper is None:
            from towerflow.tracking.shipper import MetricShipper

            run_id, client = self.run_id, self.client
            self._shipper = MetricShipper(
                lambda metrics, tags: client.log_batch(run_id, metrics=metrics, tags=tags)
            )
        return self._shipper

    def _wait_for_the_server(self) -> BaseException | None:
        """Everything logged is sent before the run is closed: wait for a server that is away.
        Returns a refusal of the store's not raised yet."""
        shipper, self._shipper = self._shipper, None
        if shipper is None:
            return None
        try:
            if shipper.failing_since is not None:
                log.warning(
                    "waiting up to %.0f s for the tracking server at %s to take the run's last %s metrics",
                    END_WAIT_S,
                    shown_address(self.tracking_uri),
                    f"{shipper.pending:,}",
                )
            if not shipper.drain(END_WAIT_S):
                raise TrainingError(
                    f"the tracking server at {shown_address(self.tracking_uri)} did not answer for "
                    f"{END_WAIT_S:.0f} s at the end of run {self.run_id} "
                    f"({without_credentials(str(shipper.last_error))}): its last {shipper.pending:,} "
                    "metrics and its status were not written. Its checkpoints written before are in the "
                    f"run: `--resume {self.run_id}` continues it"
                )
            return shipper.take_refusal()
        finally:
            shipper.close()

    def _log_params(self, params: list[Any]) -> None:
        """Params at the run's start, written at once (a server that does not answer then fails the start)."""
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=params[start : start + 100])


def _step_values(event: StepEvent) -> dict[str, float]:
    """A step's own metrics, as logged at its step."""
    values = {
        "loss": event.loss,
        "global_step": event.global_step,
        "examples_seen": event.examples_seen,
        **{f"train_{k}": v for k, v in event.metrics.items()},
        **{f"time_{k}_s": v for k, v in event.time_split.items()},
    }
    if event.examples_per_sec is not None:  # not known at the first step: no 0 to start its chart
        values["examples_per_sec"] = event.examples_per_sec
    return values
