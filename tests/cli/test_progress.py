"""The progress display's total: max_steps, or the step at which the data runs out if sooner."""

from __future__ import annotations

import io

from rich.console import Console

from towerflow.cli.progress import ProgressHook
from towerflow.runtime.hooks import SessionInfo
from towerflow.spec import load_spec


def _session(data_steps):
    spec = load_spec("pipelines/mnist_sync.yaml")
    return SessionInfo(spec=spec, num_workers=2, num_shards=2, data_steps=data_steps)


def test_the_total_is_the_first_of_max_steps_and_the_end_of_the_data():
    for max_steps, data_steps, total in (
        (1000, 468, 468),
        (1000, None, 1000),
        (200, 468, 200),
        (None, 468, 468),
    ):
        hook = ProgressHook(max_steps, console=Console(file=io.StringIO()))
        hook.after_create_session(_session(data_steps))
        assert hook.total == total, (max_steps, data_steps)
