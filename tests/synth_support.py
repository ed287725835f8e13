"""Read generated synthetic shards back (TFRecord through towerflow's parser, CSV through pandas)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from towerflow.data.tfrecord import read_tfrecord_file


def read_split(folder: Path, manifest: dict, split: str = "train") -> dict[str, np.ndarray]:
    """All columns of a split, in file order, as numpy arrays keyed by feature or column name."""
    files = [folder / name for name in manifest["splits"][split]["files"]]
    if manifest["format"] == "csv":
        frame = pd.concat([pd.read_csv(path) for path in files], ignore_index=True)
        assert list(frame.columns) == list(manifest["features"])
        return {name: frame[name].to_numpy() for name in frame.columns}
    columns: dict[str, list[np.ndarray]] = {}
    for path in files:
        for batch in read_tfrecord_file(str(path), manifest["features"]):
            for key, value in batch.items():
                columns.setdefault(key, []).append(value)
    return {key: np.concatenate(parts) for key, parts in columns.items()}
