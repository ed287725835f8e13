"""Resolve a split's paths (globs or lists) to files, and find its feature spec.

The feature spec comes from the job spec when it gives one, else from the `manifest.json` that
`towerflow data synth` writes beside its shards.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from towerflow.errors import DataError

MANIFEST = "manifest.json"


def resolve_files(patterns: list[str], *, key: str = "data.train.paths") -> list[str]:
    """Expand globs in order; every pattern must match something, and every file must exist."""
    files: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = sorted(glob.glob(os.path.expanduser(pattern)))
            matched = [m for m in matched if Path(m).name != MANIFEST and not Path(m).name.startswith(".")]
            if not matched:
                raise DataError(
                    f"{key}: {pattern!r} matches no files (working directory {os.getcwd()}). "
                    "Generate data with `towerflow data synth mnist --out data/mnist` or fix the path."
                )
            files.extend(matched)
        elif Path(pattern).expanduser().is_file():
            files.append(str(Path(pattern).expanduser()))
        else:
            raise DataError(f"{key}: no such file {pattern!r} (working directory {os.getcwd()})")
    return files


def read_manifest(files: list[str]) -> dict[str, Any] | None:
    """The manifest beside the first file, if there is one."""
    path = Path(files[0]).parent / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None


def feature_spec(source, files: list[str], *, key: str = "data.train") -> dict[str, dict[str, Any]]:
    """The features of a split as plain dicts (FeatureSpec fields), from the spec or the manifest."""
    if source.features:
        return {name: f.model_dump() for name, f in source.features.items()}
    manifest = read_manifest(files)
    if manifest and manifest.get("features"):
        return manifest["features"]
    raise DataError(
        f"{key}: no feature spec: give {key}.features (name: {{dtype, shape}}) or keep the manifest.json "
        f"that `towerflow data synth` writes beside the shards (looked in {Path(files[0]).parent})"
    )


def example_count(files: list[str]) -> int | None:
    """Total examples of these files, from the manifest, when it covers all of them."""
    manifest = read_manifest(files)
    if not manifest:
        return None
    per_file: dict[str, int] = {}
    for split in manifest.get("splits", {}).values():
        for name, count in zip(split.get("files", []), split.get("per_file", [])):
            per_file[name] = count
    names = [Path(f).name for f in files]
    if not all(n in per_file for n in names):
        return None
    return sum(per_file[n] for n in names)
