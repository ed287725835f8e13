"""Resolve a split's paths (globs or lists, local or any fsspec filesystem) to files, and read the
manifest that `towerflow data synth` writes beside its shards.

Local paths and `file://` URLs come back as plain local paths (TensorFlow reads them directly);
other URLs (`s3://...`, `gs://...`, `memory://...`) keep their protocol and are opened via fsspec.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import IO, Any

from towerflow.errors import DataError

MANIFEST = "manifest.json"
_LOCAL = ("file", "local")


def _filesystem(path: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(os.path.expanduser(path))
    except (ImportError, ValueError) as exc:  # unknown protocol or its library is not installed
        raise DataError(f"{path}: cannot open this filesystem ({exc})") from None


def is_local(path: str) -> bool:
    return "://" not in path or path.split("://", 1)[0] in _LOCAL


def _public(fs, path: str) -> str:
    """A path as users and readers see it: plain for local files, a full URL otherwise."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in _LOCAL else fs.unstrip_protocol(path)


def _keep(path: str) -> bool:
    name = PurePosixPath(path).name
    return name != MANIFEST and not name.startswith((".", "_"))


def resolve_files(patterns: list[str], *, key: str = "data.train.paths") -> list[str]:
    """Expand globs in order; every pattern must match something, and every file must exist."""
    files: list[str] = []
    for pattern in patterns:
        fs, stripped = _filesystem(pattern)
        try:
            if any(c in stripped for c in "*?["):
                matched = sorted(m for m in fs.glob(stripped) if _keep(m) and fs.isfile(m))
                if not matched:
                    raise DataError(
                        f"{key}: {pattern!r} matches no files (working directory {os.getcwd()}). "
                        "Fix the path, or generate a synthetic set: `towerflow data synth {mnist,ptb,tabular} --out DIR`."
                    )
                files.extend(_public(fs, m) for m in matched)
            elif fs.isfile(stripped):
                files.append(_public(fs, stripped))
            else:
                raise DataError(f"{key}: no such file {pattern!r} (working directory {os.getcwd()})")
        except (OSError, PermissionError) as exc:
            raise DataError(f"{key}: cannot list {pattern!r}: {exc}") from None
    return files


def open_binary(path: str) -> IO[bytes]:
    """Open a data file for reading, whatever filesystem it is on."""
    fs, stripped = _filesystem(path)
    try:
        return fs.open(stripped, "rb")
    except FileNotFoundError:
        raise vanished(path) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot open: {exc}") from None


def vanished(path: str) -> DataError:
    """The error for a file the driver found as the job started and a reader now does not: gone
    since, or not on the reader's node (a cluster without a shared disk), which it names."""
    import ray

    where = ""
    if ray.is_initialized():
        node = ray.get_runtime_context().get_node_id()
        where = f" on node {ray.util.get_node_ip_address()} (Ray node {node[:12]})"
    return DataError(
        f"{path}: file not found{where}; the driver found it as the job started: every node that reads "
        "data needs it at this path (docs/cluster.md)"
    )


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local path with this file's bytes: the file itself when local, else a temporary copy
    (TensorFlow's readers only know local paths and a few built-in filesystems)."""
    if is_local(path):
        yield path.removeprefix("file://")
        return
    with tempfile.NamedTemporaryFile(prefix="towerflow-", suffix=".shard") as tmp:
        with open_binary(path) as src:
            shutil.copyfileobj(src, tmp, 1 << 20)
        tmp.flush()
        yield tmp.name


def read_manifest(files: list[str]) -> dict[str, Any] | None:
    """The manifest beside the first file, if there is one."""
    path = f"{_folder(files[0])}/{MANIFEST}"
    fs, stripped = _filesystem(path)
    if not fs.isfile(stripped):
        return None
    try:
        with fs.open(stripped, "rb") as f:
            return json.loads(f.read())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else "."


def examples_per_file(files: list[str], manifest: dict[str, Any] | None) -> dict[str, int] | None:
    """Examples in each file, from the manifest, when it covers all of them: those of its folder
    (the first file's), named there; a file of another folder may share a name and not a count."""
    if not manifest or any(_folder(f) != _folder(files[0]) for f in files):
        return None
    per_file: dict[str, int] = {}
    for split in manifest.get("splits", {}).values():
        for name, count in zip(split.get("files", []), split.get("per_file", [])):
            per_file[name] = int(count)
    names = {f: PurePosixPath(f).name for f in files}
    if not all(n in per_file for n in names.values()):
        return None
    return {f: per_file[n] for f, n in names.items()}
