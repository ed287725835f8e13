"""The worker's config as the driver derives it from the job spec: GPU shares in particular."""

from pathlib import Path

import pytest

from towerflow.runtime.worker_config import worker_config
from towerflow.spec import load_spec

SPEC = Path(__file__).resolve().parents[2] / "pipelines" / "mnist_sync.yaml"


def tf_config_of(*overrides: str):
    spec = load_spec(SPEC, list(overrides))
    config = worker_config(spec, 0, feature_scales={}, start_step=0, faults=None, push_in_buckets=False)
    return config.tf


@pytest.mark.parametrize(("share", "towers", "gpus"), [("0", 1, 0), ("0.5", 1, 1), ("1", 1, 1), ("2", 2, 2)])
def test_a_worker_sees_every_gpu_its_share_touches(share, towers, gpus):
    config = tf_config_of(f"cluster.gpus_per_worker={share}", f"cluster.towers={towers}")
    assert config.gpus == gpus


def test_workers_sharing_a_gpu_grow_their_memory():
    """Two workers at 0.5 GPU: the first must not reserve the card the second needs."""
    config = tf_config_of("cluster.gpus_per_worker=0.5", "tf_config.memory_growth=false")
    assert config.memory_growth


def test_a_memory_limit_is_kept_where_workers_share_a_gpu():
    config = tf_config_of(
        "cluster.gpus_per_worker=0.5", "tf_config.memory_growth=false", "tf_config.memory_limit_mb=1024"
    )
    assert (config.memory_growth, config.memory_limit_mb) == (False, 1024)


def test_whole_gpus_keep_the_memory_setting_asked_for():
    config = tf_config_of("cluster.gpus_per_worker=1", "tf_config.memory_growth=false")
    assert not config.memory_growth


def test_a_worker_runs_under_a_config_built_alike_and_not_under_another_label_or_model():
    spec = load_spec(SPEC, [])
    mine = worker_config(spec, 0, feature_scales={"x": 2.0}, start_step=0, faults=None, push_in_buckets=False)
    # another id, start step and profile: what a spare or a new driver's worker takes (`assume`)
    later = worker_config(
        spec, 1, feature_scales={"x": 2.0}, start_step=50, faults=None, push_in_buckets=False
    )
    assert later.built_alike(mine)
    relabelled = load_spec(SPEC, ["data.train.label=other"])
    other = worker_config(
        relabelled, 0, feature_scales={"x": 2.0}, start_step=0, faults=None, push_in_buckets=False
    )
    assert not other.built_alike(mine)
    rescaled = worker_config(
        spec, 0, feature_scales={"x": 3.0}, start_step=0, faults=None, push_in_buckets=False
    )
    assert not rescaled.built_alike(mine)
