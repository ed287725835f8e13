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
