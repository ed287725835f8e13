"""What a split's records hold and what the model receives: the feature spec (from the job spec,
the manifest, or inferred from the first records), groups of features concatenated into one dense
tensor, and the per-batch steps that turn parsed columns into model-ready columns.

Feature specs travel as plain dicts (FeatureSpec fields) so Ray tasks can take them cheaply.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from towerflow.errors import DataError
from towerflow.shared_types import NOT_INPUTS  # never model inputs (contract), like the label

_FEATURE_DEFAULTS = {
    "shape": [],
    "default": None,
    "decode": None,
    "decoded_shape": None,
    "scale": None,
    "varlen": False,
    "pad_to": None,
    "ragged": False,
}
_DTYPES = ("int64", "float32", "bytes")


def normalize(features: dict[str, dict[str, Any]], *, origin: str) -> dict[str, dict[str, Any]]:
    """Every feature with every field, checked (manifest features are not validated elsewhere)."""
    out = {}
    for name, raw in features.items():
        if not isinstance(raw, dict) or raw.get("dtype") not in _DTYPES:
            raise DataError(f"{origin}: feature {name!r} needs dtype int64, float32 or bytes (got {raw!r})")
        unknown = set(raw) - set(_FEATURE_DEFAULTS) - {"dtype"}
        spec = {"dtype": raw["dtype"], **{k: raw.get(k, v) for k, v in _FEATURE_DEFAULTS.items()}}
        spec["shape"] = [int(d) for d in (spec["shape"] or [])]
        spec["extra"] = sorted(unknown)  # data-set specific keys of a manifest are kept out of the way
        out[name] = spec
    return out


def expand_groups(
    groups: dict[str, list[str]] | None, features: dict[str, dict[str, Any]], label: str
) -> dict[str, list[str]]:
    """Each group's member features: patterns expand in sorted name order; checked for clashes."""
    if not groups:
        return {}
    expanded: dict[str, list[str]] = {}
    taken: dict[str, str] = {}
    names = sorted(features)
    for group, patterns in groups.items():
        members: list[str] = []
        for pattern in patterns:
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise DataError(
                    f"data.train.groups.{group}: {pattern!r} matches no feature (features: {', '.join(names)})"
                )
            members.extend(m for m in matched if m not in members)
        for member in members:
            if member == label or member in NOT_INPUTS:
                raise DataError(f"data.train.groups.{group}: {member!r} is the label or an id, not an input")
            if member in taken:
                raise DataError(f"data.train.groups: {member!r} is in both {taken[member]!r} and {group!r}")
            spec = features[member]
            if spec["dtype"] == "bytes" and spec["decode"] is None:
                raise DataError(
                    f"data.train.groups.{group}: {member!r} holds bytes; only numbers can be grouped"
                )
            if spec["varlen"]:
                raise DataError(
                    f"data.train.groups.{group}: {member!r} is varlen; only fixed-length features group"
                )
            taken[member] = group
        if group in features and group not in members:
            raise DataError(f"data.train.groups: group name {group!r} is already a feature's name")
        expanded[group] = members
    return expanded


@dataclass
class ColumnPlan:
    """Per-batch steps after parsing, run inside the Ray Data tasks (vectorized, NumPy)."""

    features: dict[str, dict[str, Any]]
    groups: dict[str, list[str]] = field(default_factory=dict)
    preprocess: list[str] = field(default_factory=list)  # import refs, resolved once per process
    _fns: list[Any] | None = field(default=None, repr=False)

    def __call__(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for group, members in self.groups.items():
            parts = [_as_matrix(columns.pop(m), self.features[m].get("scale")) for m in members]
            columns[group] = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        for fn in self.functions():
            columns = fn(columns)
            if not isinstance(columns, dict):
                raise DataError(
                    f"data.train.preprocess: a function returned {type(columns).__name__}, not a dict"
                )
        return columns

    def functions(self) -> list[Any]:
        """The preprocess functions, imported on first use (a bad import string raises DataError)."""
        if self._fns is None:
            from towerflow.imports import import_ref

            self._fns = [import_ref(ref, key="data.train.preprocess") for ref in self.preprocess]
        return self._fns

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fns": None}


def _as_matrix(column: np.ndarray, scale: float | None) -> np.ndarray:
    column = np.asarray(column, dtype=np.float32)
    if scale is not None:
        column = column * np.float32(scale)
    return column.reshape(len(column), -1) if column.ndim != 2 else column


def describe(name: str, spec: dict[str, Any]) -> str:
    """One line per feature, as inference reports it."""
    shape = "varlen" if spec.get("varlen") else str(list(spec.get("shape") or []))
    return f"{name}: {spec['dtype']} {shape}"
