"""towerflow/submit.py's pieces that need no cluster: the job server's address, the runtime
environment and the entrypoint. The submission itself runs against a real head in
tests/cli/test_job_submit.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from conftest import REPO

from towerflow.errors import ClusterError, SpecError
from towerflow.submit import entrypoint, job_server_address, runtime_env


def test_the_job_server_comes_from_address_or_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_server_address("http://head:8265") == "http://head:8265"
    with pytest.raises(ClusterError, match="--address http://HEAD:8265"):
        job_server_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ClusterError, match="RAY_ADDRESS=10.0.0.1:6379 is a GCS address"):
        job_server_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.1:8265")
    assert job_server_address(None) == "http://10.0.0.1:8265"


def test_the_runtime_env_is_the_repository_with_the_shells_tracking_uri(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    env = runtime_env(REPO)
    assert env["working_dir"] == str(REPO)
    assert env["env_vars"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["env_vars"]["TF_CPP_MIN_LOG_LEVEL"] == "2"  # from cluster/runtime_env.yaml
    assert "data/" in env["excludes"]
    assert runtime_env(REPO, "http://mlflow.towerflow:5000")["env_vars"]["MLFLOW_TRACKING_URI"] == (
        "http://mlflow.towerflow:5000"
    )


def test_the_entrypoint_trains_with_resume_auto_and_quotes_each_override():
    command = entrypoint(
        Path("pipelines/mnist_sync.yaml"), ["training.max_steps=5", "tracking.experiment=a b"]
    )
    assert shlex.split(command) == [
        "python", "-m", "towerflow", "train", "pipelines/mnist_sync.yaml", "--resume", "auto",
        "--set", "training.max_steps=5", "--set", "tracking.experiment=a b",
    ]  # fmt: skip


def test_a_runtime_env_file_that_is_not_yaml_is_named(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "runtime_env.yaml").write_text("env_vars: [unclosed\n")
    with pytest.raises(SpecError, match=r"cluster/runtime_env\.yaml: not a readable YAML file"):
        runtime_env(tmp_path)
