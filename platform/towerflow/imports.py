"""Resolve `package.module:attribute` strings: how the core reaches models/ and pipelines/."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from towerflow.errors import SpecError


class UnimportableModule(SpecError):
    """The module cannot be imported in this process. Ray may still ship it to the actors (a
    runtime_env working_dir that the driver's own directory lacks), so only they can tell for sure."""


def import_ref(ref: str, *, key: str = "model.ref") -> Any:
    """Import `module:attr`; a SpecError names the spec key and what was missing."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"{key}: {ref!r} is not an import string of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UnimportableModule(
            f"{key}: cannot import {module_name!r} ({exc}). Run from the repository root, or ship it with "
            "`ray job submit --working-dir .`"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SpecError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None


def check_arguments(function: Callable[..., Any], params: Mapping[str, Any], *, key: str, ref: str) -> None:
    """Fail with a SpecError naming `key` when `params` do not fit `function`'s signature, before any
    actor starts: a misspelt model parameter would otherwise surface as a worker that died."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # nothing to check against (a C function, say)
        return
    try:
        signature.bind(**params)
    except TypeError as exc:
        takes = ", ".join(signature.parameters) or "no parameters"
        raise SpecError(f"{key}: {exc} ({ref} takes: {takes})") from None
