"""Read a YAML job spec, apply `--set a.b=value` overrides, validate, and flatten for logging."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from towerflow.errors import SpecError
from towerflow.spec.schema import JobSpec


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Load and validate a job spec; raise SpecError naming the file and the offending key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: a folder, not a spec file (pipelines/*.yaml are specs)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read the spec file: {exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecError(
            f"{path}: a job spec is a YAML mapping (name:, model:, data:, ...), got {type(raw).__name__}"
        )
    for item in overrides:
        apply_override(raw, item)
    return validate_spec(raw, source=str(path))


def validate_spec(raw: Mapping[str, Any], source: str = "spec") -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(f"{source}: invalid job spec:\n" + format_validation_error(exc, raw)) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in the raw spec; the value is parsed as YAML (numbers, booleans, null, lists)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise SpecError(f"--set {item!r}: expected KEY=VALUE, for example --set training.max_steps=200")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise SpecError(f"--set {key}: {where} is a value ({child!r}), not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(exc: ValidationError, raw: Any = None) -> str:
    lines = []
    for err in exc.errors():
        loc = _location(err["loc"], raw)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key (check its spelling and section)"
        given = err.get("input")
        shown = (
            f" (got {given!r})" if err["type"] not in ("missing", "extra_forbidden") and _short(given) else ""
        )
        lines.append(f"  - {loc or 'spec'}: {message}{shown}")
    return "\n".join(lines)


def flatten_spec(spec: JobSpec) -> dict[str, str]:
    """`{"training.optimizer.name": "adam", ...}`: the spec as flat params for tracking."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = str(value)

    walk("", spec.model_dump(mode="json"))
    return flat


def _location(loc: tuple[Any, ...], raw: Any) -> str:
    """A pydantic error's location as the spec's keys: the keys and indexes found in the raw spec
    (a feature named `Age` among them), without the union member tags pydantic puts between
    them, which no spec holds."""
    parts, node = [], raw
    for part in loc:
        if (
            isinstance(node, Mapping)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and 0 <= part < len(node)
        ):
            node = node[part]
        elif _is_union_tag(part):
            continue
        else:  # a key the spec lacks (a missing field), or below a value
            node = None
        parts.append(str(part))
    return ".".join(parts)


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the member type of a union into the location ("float", "LearningRateSchedule").
    # Discriminated unions use "tag:..." tags (schema.LearningRate).
    return isinstance(part, str) and (
        part[:1].isupper() or part in {"float", "str", "list[str]", "int"} or part.startswith("tag:")
    )


def _short(value: Any) -> bool:
    return not isinstance(value, dict | list) and len(repr(value)) < 80
