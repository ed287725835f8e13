"""A user hook loaded by import string (`sample_hooks:RecordingHook`) in the supervision tests."""

from __future__ import annotations

from towerflow import Hook


class RecordingHook(Hook):
    instances: list[RecordingHook] = []

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.calls: list[str] = []
        self.events = []
        self.metrics: list[tuple[int, dict]] = []
        RecordingHook.instances.append(self)

    def begin(self, session) -> None:
        self.calls.append("begin")

    def after_create_session(self, session) -> None:
        self.calls.append("after_create_session")
        self.data_steps = session.data_steps

    def before_run(self, context, global_step) -> None:
        if "before_run" not in self.calls:
            self.calls.append("before_run")

    def after_run(self, context, event) -> None:
        if "after_run" not in self.calls:
            self.calls.append("after_run")
        self.events.append(event)

    def on_metrics(self, metrics, step) -> None:
        self.metrics.append((step, dict(metrics)))

    def end(self, session, outcome) -> None:
        self.calls.append(f"end:{outcome.status}")


class FailsAtEndHook(Hook):
    """Raises in `end`, as a user's upload or export step might after training went well."""

    def end(self, session, outcome) -> None:
        raise OSError("the bucket refused the upload")


class StopAtStepHook(Hook):
    """Asks the run to stop once it has heard of global step `step` (a user hook stopping a job)."""

    def __init__(self, step: int = 3) -> None:
        self.step = step

    def after_run(self, context, event) -> None:
        if event.global_step >= self.step:
            context.request_stop(f"reached step {self.step}")


class ListeningAddressesHook(Hook):
    """Writes, once the cluster is up, the addresses that this driver's Ray processes listen on, and
    whether token authentication is on."""

    def __init__(self, out: str) -> None:
        self.out = out

    def after_create_session(self, session) -> None:
        import json

        import psutil

        # The embedded Ray's GCS and raylet are this process's children; its workers, theirs.
        family = {p.pid: p.name() for p in psutil.Process().children(recursive=True)}
        listening = [
            {"process": family[c.pid], "address": c.laddr.ip, "port": c.laddr.port}
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in family
        ]
        from ray._raylet import AuthenticationMode, get_authentication_mode

        # The mode this driver's Ray runs in, and what its GCS server was started with.
        token_auth = get_authentication_mode() == AuthenticationMode.TOKEN
        gcs = [p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server"]
        gcs_auth = [p.environ().get("RAY_AUTH_MODE") for p in gcs]
        with open(self.out, "w") as f:
            json.dump({"listening": listening, "token_auth": token_auth, "gcs_auth_mode": gcs_auth}, f)


class SlowEndHook(Hook):
    """Takes `seconds` to end, and says so first: time for a second stop signal to land in it."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds

    def end(self, session, outcome) -> None:
        import sys
        import time

        print("towerflow-test: SlowEndHook ending", file=sys.stderr, flush=True)
        time.sleep(self.seconds)
