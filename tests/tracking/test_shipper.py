"""The run's metrics go to the tracking server from a thread of their own (tracking/shipper.py):
in order, kept and sent again while the server is away, refusals handed to the driver. End to end:
a real tracking server stopped mid-run and started again while `towerflow train` trains on."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import REPO
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import RestException
from mlflow.tracking import MlflowClient
from support import ONE_OF_EACH, blob_spec
from tracking_server import process_tree, tracking_server_fixture  # noqa: F401

from towerflow.checkpoint.files import checkpoint_name
from towerflow.checkpoint.mlflow_store import MlflowCheckpointStore
from towerflow.tracking.shipper import MetricShipper

FAST = {"backoff_s": (0.01, 0.05)}


def _metrics(name: str, count: int) -> list[Metric]:
    return [Metric(name, float(i), 0, i) for i in range(count)]


class Server:
    """A `send` that fails while `away` is set, and records what it took."""

    def __init__(self, failures: list[Exception] | None = None) -> None:
        self.failures = list(failures or [])
        self.taken: list[tuple[list, list]] = []
        self.away = threading.Event()

    def send(self, metrics, tags) -> None:
        if self.away.is_set():
            raise ConnectionError("connection refused")
        if self.failures:
            raise self.failures.pop(0)
        self.taken.append((metrics, tags))


def test_batches_go_in_order_and_are_sent_again_until_the_server_takes_them():
    server = Server([ConnectionError("refused"), TimeoutError("timed out"), ConnectionError("refused")])
    shipper = MetricShipper(server.send, **FAST)
    shipper.put(_metrics("a", 3))
    shipper.put(_metrics("b", 2500), [RunTag("t", "1")])  # more than a batch: split, tags with the first
    assert shipper.drain(10)
    assert [(m[0].key, len(m), len(t)) for m, t in server.taken] == [
        ("a", 3, 0),
        ("b", 1000, 1),
        ("b", 1000, 0),
        ("b", 500, 0),
    ]
    assert [m.step for m, _ in server.taken[1:] for m in m] == list(range(2500))
    assert shipper.failing_since is None and shipper.pending == 0 and shipper.dropped == 0
    shipper.close()


def test_a_refused_batch_is_dropped_and_its_error_handed_over_once():
    refusal = RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad key"})
    busy = RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "try later"})
    server = Server([busy, refusal])
    shipper = MetricShipper(server.send, **FAST)
    shipper.put(_metrics("refused", 1))  # busy once (sent again), then refused
    shipper.put(_metrics("next", 1))
    assert shipper.drain(10)
    assert [m[0].key for m, _ in server.taken] == ["next"]
    assert shipper.take_refusal() is refusal and shipper.take_refusal() is None
    shipper.close()


def test_a_local_stores_refusal_is_no_outage(tmp_path):
    """The SQLite store refuses a deleted run's metrics itself (an MlflowException, INVALID_PARAMETER_VALUE):
    handed over as a refusal, not sent again for ever as if a server were away."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("gone")).info.run_id
    client.delete_run(run_id)  # in the UI, while the run trains
    shipper = MetricShipper(lambda metrics, tags: client.log_batch(run_id, metrics, tags=tags), **FAST)
    shipper.put(_metrics("loss", 2))
    assert shipper.drain(10) and shipper.failing_since is None
    assert "deleted" in str(shipper.take_refusal())
    shipper.close()


def test_while_the_server_is_away_the_oldest_metrics_make_room_and_tags_stay():
    server = Server()
    server.away.set()
    shipper = MetricShipper(server.send, max_pending=2500, **FAST)
    shipper.put(_metrics("old", 1000), [RunTag("fault", "a worker was lost")])
    shipper.put(_metrics("older", 1000))
    shipper.put(_metrics("new", 1000))
    assert not shipper.drain(0.2) and shipper.failing_since is not None
    assert shipper.dropped == 1000 and shipper.pending == 2000
    server.away.clear()
    assert shipper.drain(10)
    sent = [(m[0].key if m else None, [t.key for t in tags]) for m, tags in server.taken]
    # The batch out when room was needed stays whole; the next oldest goes.
    assert sent in ([("old", ["fault"]), ("new", [])], [(None, ["fault"]), ("older", []), ("new", [])])
    shipper.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_goes_on_while_the_tracking_server_is_away_and_loses_nothing(
    tracking_server, blob_data, tmp_path, monkeypatch
):
    """At step 100 every process of the tracking server is stopped (SIGSTOP: it holds its port and
    answers nothing, as a server cut off by the network) until the driver has said that both a
    metrics batch and a checkpoint met the outage, then let go on (an outage sized by what it
    hit, not by a clock). Every step's metrics reach it, the checkpoints due meanwhile are skipped
    with a warning or, where the workers trained past them while the driver waited out the
    timeouts, taken at a later step, the later ones are written, and the run ends FINISHED. MLflow's clients are told to give up after 2 s
    and not to retry, so that each write meets the outage instead of riding it out inside
    MLflow's own retries (about four minutes of them by default)."""
    max_steps = 800  # 20 ms a step: the outage ends by step ~300 in a fast hour, after step 800 in a slow one
    both = ("did not take the run's metrics", "checkpoint skipped, training goes on")
    raw = blob_spec(
        blob_data,
        name="outage",
        data={"epochs": None},
        cluster=ONE_OF_EACH,
        training={"max_steps": max_steps},
        tracking={"tracking_uri": tracking_server.uri, "experiment": "outage"},
        supervision={"checkpoint": {"every_steps": 100}, "log_every_steps": 1},
    )
    spec = tmp_path / "outage.yaml"
    spec.write_text(yaml.safe_dump(raw))
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    driver = subprocess.Popen(
        [sys.executable, "-m", "towerflow", "train", str(spec), "--no-progress"],
        cwd=REPO,
        env={**_environ(), **tracking_server.env, **quick, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for key, value in tracking_server.env.items():
        monkeypatch.setenv(key, value)
    output = _Output(driver)
    server = process_tree(tracking_server.server.process.pid)
    try:
        client = MlflowClient(tracking_server.uri)
        run_id = _wait_for_step(client, 100, driver, output)
        for process in server:
            process.suspend()
        deadline = time.monotonic() + 60
        while not output.has(*both) and time.monotonic() < deadline:
            time.sleep(0.2)
        for process in server:
            process.resume()
        driver.wait(timeout=240)
        out = output.text()
    finally:
        for process in server:
            with contextlib.suppress(psutil.Error):
                process.resume()
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED", out
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert steps == list(range(1, max_steps + 1))  # nothing lost in the outage
    assert all(m in out for m in both) and "takes the run's metrics again" in out, out
    skipped = {
        int(step)
        for step in re.findall(r"checkpoint skipped, training goes on: checkpoint of step (\d+)", out)
    }
    assert skipped, out
    # A checkpoint due at a step the shards had moved past (the driver blocked in the outage's
    # timeouts while the workers trained on: on a slow machine to the run's end) is taken at a
    # later step, and says so; the steps due in between pass with it. Nothing vanishes unsaid.
    later = {
        int(due): int(taken)
        for due, taken in re.findall(r"checkpoint due at step (\d+) taken at step (\d+)", out)
    }
    written = sorted(
        {
            step
            for step in range(100, max_steps + 1, 100)
            if step not in skipped and not any(due <= step < taken for due, taken in later.items())
        }
        | set(later.values())
    )
    listed = [step for step, _ in MlflowCheckpointStore(client, run_id).list()]
    assert listed == written[-5:], (listed, skipped, later, out)
    assert listed[-1] == max_steps, (listed, out)  # the checkpoints after the outage are written
    # Nothing is left of the skipped checkpoints (parts of one that reached the server go with a
    # later save's pruning).
    left = sorted(Path(e.path).name for e in client.list_artifacts(run_id, "checkpoints"))
    assert left == [checkpoint_name(step) for step in listed], (left, out)


class _Output:
    """The driver's output, read by a thread as it comes, so the test can wait for lines in it."""

    def __init__(self, driver: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(driver.stdout), daemon=True)
        self._reader.start()

    def has(self, *markers: str) -> bool:
        return all(any(marker in line for line in self.lines) for marker in markers)

    def text(self) -> str:
        """All of it, once the driver has exited (its end of the pipe closed)."""
        self._reader.join(timeout=10)
        return "".join(self.lines)


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}


def _wait_for_step(
    client: MlflowClient, step: int, driver: subprocess.Popen, output: _Output, timeout: float = 180
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.poll() is not None:
            raise AssertionError(f"the driver exited with {driver.returncode}:\n{output.text()}")
        found = client.get_experiment_by_name("outage")
        runs = client.search_runs([found.experiment_id]) if found else []
        if runs and runs[0].data.metrics.get("global_step", 0) >= step:
            return runs[0].info.run_id
        time.sleep(0.3)
    raise TimeoutError(f"no step {step} within {timeout:.0f} s")


def test_a_discarding_close_sends_nothing_more():
    """A driver whose run another driver took over drops what it still holds: sent later (a
    server back while a batch was in flight), it would land among the new driver's metrics and
    tags. A plain close sends the rest; a discarding one nothing after the batch in flight."""
    for discard in (False, True):
        sending, release, taken = threading.Event(), threading.Event(), []

        def send(metrics, tags, sending=sending, release=release, taken=taken) -> None:
            sending.set()
            release.wait(10)  # the first batch in flight until released
            taken.append(metrics[0].key)

        shipper = MetricShipper(send, **FAST)
        shipper.put(_metrics("in-flight", 1))
        assert sending.wait(10)
        shipper.put(_metrics("held", 10), [RunTag("towerflow.fault.004", "the head went silent")])
        closing = threading.Thread(target=shipper.close, kwargs={"discard": discard})
        closing.start()
        time.sleep(0.1)
        release.set()
        closing.join(10)
        assert taken == (["in-flight"] if discard else ["in-flight", "held"]), discard


def test_a_first_checkpoint_due_while_the_server_is_away_is_skipped_not_a_crash(tmp_path, monkeypatch):
    """The run's artifact location is asked of the server at the first checkpoint: away then, the
    checkpoint is skipped (StoreUnavailable), as a part's upload would be, not the run failed."""
    import socket

    from towerflow.checkpoint.stores import StoreUnavailable

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        away = f"http://127.0.0.1:{closed.getsockname()[1]}"
    store = MlflowCheckpointStore(MlflowClient(away), "0" * 32)
    with pytest.raises(StoreUnavailable, match=f"checkpoint of step 10: .* was not read from {away}"):
        store.writer(10)
