"""Resolve `package.module:attribute` strings: how the core reaches models/ and pipelines/."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import inspect
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from towerflow.errors import SpecError


class UnimportableModule(SpecError):
    """The module cannot be imported in this process. Ray may still ship it to the actors (a
    runtime_env working_dir that the driver's own directory lacks), so only they can tell for sure."""


def import_ref(ref: str, *, key: str = "model.ref") -> Any:
    """Import `module:attr`; a SpecError names the spec key and what was missing or failed."""
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
    except Exception as exc:  # the user's module itself failed: bad input, named with where it failed
        raise SpecError(f"{key}: importing {module_name!r} failed: {_where_it_failed(exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SpecError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None


def _where_it_failed(exc: Exception) -> str:
    """`exc` and the file and line that raised it: a syntax error's own, else the innermost frame
    outside the import machinery (the user's code, or what it imported)."""
    if isinstance(exc, SyntaxError):
        return f"{exc.filename}, line {exc.lineno}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def import_user_code(ref: str, *, key: str = "model.ref") -> Any:
    """`import_ref` in a process that has no TensorFlow of its own (the driver, a command): a user's
    module may import TensorFlow at its top, which would load it whole and on every GPU, so it is
    imported first as tf_import.py does it. A module not found here fails without it."""
    from towerflow.tf_import import import_tensorflow

    if _module_spec(ref.partition(":")[0]) is not None:
        import_tensorflow(gpus=False)
    return import_ref(ref, key=key)


def _module_spec(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """Where the module lies, found without running it (its parent packages do run); None if not here."""
    try:
        return importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package missing, or no name at all
        return None


def signature_from_source(ref: str) -> inspect.Signature | None:
    """The signature of `module:function` read from the module's source, without running the module
    (a model's module imports Keras: seconds of CPU for a process that needs no TensorFlow). None
    where the source does not settle it: no source found, or the name bound at the module's top
    level otherwise than by one undecorated `def` (a class, an import, an assignment, twice)."""
    module_name, _, attr = ref.partition(":")
    found = _module_spec(module_name)
    try:
        source = found.loader.get_source(module_name) if found and found.loader else None
        tree = ast.parse(source) if source else None
    except (ImportError, AttributeError, OSError, SyntaxError, ValueError):
        return None
    if tree is None:
        return None
    binders = [node for node in tree.body if _names_bound(node) & {attr, "*"}]
    if len(binders) != 1 or not isinstance(binders[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    if binders[0].decorator_list:  # a decorator may change the signature
        return None
    return _signature(binders[0].args)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _names_bound(statement: ast.stmt) -> set[str]:
    """Names a top-level statement binds in its module ("*" for a star import: any name)."""
    names = set()
    for node in _outside_inner_scopes(statement):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _outside_inner_scopes(node: ast.AST) -> Iterator[ast.AST]:
    """`node` and what it holds, without looking inside a function, class or lambda (a scope of its
    own, whose name alone is bound where it stands)."""
    yield node
    if not isinstance(node, _SCOPES):
        for child in ast.iter_child_nodes(node):
            yield from _outside_inner_scopes(child)


def _signature(args: ast.arguments) -> inspect.Signature:
    """An inspect.Signature of a def's parameters: names, kinds and which have defaults (their
    values are not evaluated; only whether they exist matters for binding)."""
    Parameter = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    parameters = [
        Parameter(
            arg.arg,
            Parameter.POSITIONAL_ONLY if i < len(args.posonlyargs) else Parameter.POSITIONAL_OR_KEYWORD,
            default=None if i >= first_default else Parameter.empty,
        )
        for i, arg in enumerate(positional)
    ]
    if args.vararg:
        parameters.append(Parameter(args.vararg.arg, Parameter.VAR_POSITIONAL))
    parameters += [
        Parameter(arg.arg, Parameter.KEYWORD_ONLY, default=Parameter.empty if default is None else None)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        parameters.append(Parameter(args.kwarg.arg, Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)


def check_arguments(
    target: Callable[..., Any] | inspect.Signature, params: Mapping[str, Any], *, key: str, ref: str
) -> None:
    """Fail with a SpecError naming `key` when `params` do not fit `target` (a function, or its
    signature), before any actor starts: a misspelt model parameter would otherwise surface as a
    worker that died."""
    try:
        signature = target if isinstance(target, inspect.Signature) else inspect.signature(target)
    except (TypeError, ValueError):  # nothing to check against (a C function, say)
        return
    try:
        signature.bind(**params)
    except TypeError as exc:
        takes = ", ".join(signature.parameters) or "no parameters"
        raise SpecError(f"{key}: {exc} ({ref} takes: {takes})") from None
