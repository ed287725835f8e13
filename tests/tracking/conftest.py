"""A real tracked run with an exported, registered model, shared by the export and UI tests."""

from __future__ import annotations

import pytest
from support import ONE_OF_EACH, tracked_spec

from towerflow.launch import train


@pytest.fixture(scope="session")
def exported_run(ray_cluster, blob_data, tmp_path_factory):
    """(spec, tracking URI, TrainResult) of a 6-step sync run registered as blobs-mlp@champion."""
    spec, uri = tracked_spec(
        tmp_path_factory.mktemp("export"),
        blob_data,
        "export",
        cluster=ONE_OF_EACH,
        training={"max_steps": 6},
        export={"saved_model": True, "register_as": "blobs-mlp"},
    )
    return spec, uri, train(spec)
