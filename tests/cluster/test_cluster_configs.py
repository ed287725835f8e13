"""cluster/: the cluster launcher config validates against Ray's own schema (as `ray up` checks
it, after filling in the provider's defaults), names images of the Ray version pyproject pins,
starts every node with token auth and the settings every towerflow node has, and the job runtime
environment holds no secret."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
import yaml
from conftest import REPO
from ray.autoscaler._private.util import prepare_config, validate_config

from towerflow.runtime.cluster import RAY_NODE_ENV

CLUSTER = REPO / "cluster"


def _launcher_config() -> dict:
    return yaml.safe_load((CLUSTER / "aws.yaml").read_text())


def _pinned_ray() -> str:
    return re.search(r'"ray\[[^\]]*\]>=(\d+\.\d+)', (REPO / "pyproject.toml").read_text()).group(1)


def test_the_launcher_config_is_what_ray_up_accepts():
    config = prepare_config(copy.deepcopy(_launcher_config()))
    validate_config(config)
    types = config["available_node_types"]
    assert set(types) == {"head.cpu", "worker.cpu", "worker.gpu"}
    assert types["head.cpu"]["resources"] == {"CPU": 0}  # no training actor on the head


def test_an_unknown_key_is_refused_as_ray_up_would():
    config = _launcher_config()
    config["available_node_types"]["worker.cpu"]["min_wokers"] = 1
    with pytest.raises(jsonschema.ValidationError, match="min_wokers"):
        validate_config(prepare_config(config))


def test_every_image_matches_the_pinned_ray_and_every_node_starts_with_towerflows_settings():
    text = (CLUSTER / "aws.yaml").read_text()
    images = re.findall(r"towerflow:ray(\d+\.\d+)\.\d+-py\d+", text)
    assert images and set(images) == {_pinned_ray()}
    starts = _launcher_config()["head_start_ray_commands"] + _launcher_config()["worker_start_ray_commands"]
    ray_starts = [c for c in starts if c.strip().split()[:2] != ["ray", "stop"]]
    assert ray_starts and all("RAY_AUTH_MODE=token" in c for c in ray_starts)
    node_env = [f"{name}={value}" for name, value in RAY_NODE_ENV.items()]
    assert all(setting in c for c in ray_starts for setting in node_env), ray_starts


def test_the_job_runtime_env_ships_no_data_and_no_secret():
    env = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert {"data/", "mlruns/"} <= set(env["excludes"])
    secretish = [k for k in env.get("env_vars", {}) if re.search(r"PASSWORD|TOKEN|SECRET|KEY", k)]
    assert secretish == []
