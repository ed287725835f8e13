"""Resolve `package.module:attribute` strings: how the core reaches models/ and pipelines/."""

from __future__ import annotations

import importlib
from typing import Any

from towerflow.errors import SpecError


def import_ref(ref: str, *, key: str = "model.ref") -> Any:
    """Import `module:attr`; a SpecError names the spec key and what was missing."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"{key}: {ref!r} is not an import string of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SpecError(
            f"{key}: cannot import {module_name!r} ({exc}). Run from the repository root, or ship it with "
            "`ray job submit --working-dir .`"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SpecError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None
