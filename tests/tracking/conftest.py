"""A real tracked run with an exported, registered model, shared by the export and UI tests."""

from __future__ import annotations

import pytest
from support import blob_spec

from towerflow.launch import train
from towerflow.spec import validate_spec


@pytest.fixture(scope="session")
def exported_run(ray_cluster, blob_data, tmp_path_factory):
    """(spec, tracking URI, TrainResult) of a 6-step sync run registered as blobs-mlp@champion."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('export') / 'mlflow.db'}"
    spec = validate_spec(
        blob_spec(
            blob_data,
            tracking={"tracking_uri": uri, "experiment": "export"},
            training={"max_steps": 6},
            export={"saved_model": True, "register_as": "blobs-mlp"},
        )
    )
    return spec, uri, train(spec)
