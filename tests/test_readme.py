"""The README's Python API example runs as printed, in a fresh process, from a folder laid out as the
repository root (models/, pipelines/ and a small synthetic data/mnist), with the embedded defaults."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient

from towerflow.runtime.cluster import AUTH_MODE, SINGLE_MACHINE_SWITCH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _python_api_example() -> str:
    section = (REPO / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return code


def test_the_python_api_example_runs_as_printed(tmp_path):
    for folder in ("models", "pipelines"):
        (tmp_path / folder).symlink_to(REPO / folder)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", SINGLE_MACHINE_SWITCH, AUTH_MODE)}
    env.pop("MLFLOW_TRACKING_URI", None)
    synth = [sys.executable, "-m", "towerflow", "data", "synth", "mnist", "--out", "data/mnist"]
    synth += ["--examples", "2048", "--eval-examples", "256", "--shards", "2", "--no-progress"]
    subprocess.run(synth, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)

    out = subprocess.run(
        [sys.executable, "-c", _python_api_example()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary, ids = out.stdout.strip().splitlines()[-2:]
    assert summary.startswith("run ") and "finished steps=20" in summary and "accuracy=" in summary
    run_id = ids.split()[0]
    assert "to opt out" not in out.stderr and "listens on" not in out.stderr
    # towerflow's messages show, as the CLI shows them, where the script set up no logging of its own
    assert "towerflow: cluster.cpus_per_worker: auto -> " in out.stderr, out.stderr[-3000:]
    assert "DeprecationWarning" not in out.stderr, out.stderr[-3000:]
    # The run is in the store in the working directory, where `mlflow ui` started there looks.
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["global_step"] == 20
