"""What a run records about where it ran: library versions, the Ray cluster's shape, the git commit.

Each function returns plain strings, ready for MLflow params or tags, and never fails a run: a
missing library, no Ray, or no git repository just leaves its entries out.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import platform as std_platform
import subprocess
from importlib.metadata import PackageNotFoundError, version

LIBRARIES = ("towerflow", "ray", "tensorflow", "keras", "mlflow")


def library_versions() -> dict[str, str]:
    """`{"towerflow": "0.1.0", "ray": ..., "tensorflow": ..., "keras": ..., "mlflow": ..., "python": ...}`."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    versions["python"] = std_platform.python_version()
    return versions


def cluster_shape() -> dict[str, str]:
    """Nodes, CPUs and GPUs of the Ray cluster this process is connected to (empty without Ray)."""
    import ray

    if not ray.is_initialized():
        return {}
    resources = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return {
        "cluster.nodes": str(len(nodes)),
        "cluster.cpus": f"{resources.get('CPU', 0):g}",
        "cluster.gpus": f"{resources.get('GPU', 0):g}",
    }


def git_state(workdir: str | os.PathLike | None = None) -> dict[str, str]:
    """Commit, branch and dirty flag of the git work tree holding `workdir` (default: the current
    directory); empty when it is not in one or git is not installed."""
    cwd = os.fspath(workdir or os.getcwd())

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    state = {
        "commit": commit,
        "dirty": "true" if git("status", "--porcelain", "--untracked-files=no") else "false",
    }
    branch = git("rev-parse", "--abbrev-ref", "HEAD")
    if branch and branch != "HEAD":
        state["branch"] = branch
    return state


def run_tags(mode: str, workdir: str | os.PathLike | None = None) -> dict[str, str]:
    """Tags of a towerflow run: mode, user, `<library>.version`, and the git state under both MLflow's
    own `mlflow.source.git.*` names (the UI shows them) and `towerflow.git.*`."""
    tags = {"mode": mode}
    with contextlib.suppress(KeyError, OSError):  # no user name for this uid (some containers)
        tags["mlflow.user"] = getpass.getuser()
    tags.update({f"{name}.version": v for name, v in library_versions().items()})
    git = git_state(workdir)
    if git:
        tags["mlflow.source.git.commit"] = git["commit"]
        if "branch" in git:
            tags["mlflow.source.git.branch"] = git["branch"]
        tags.update({f"towerflow.git.{key}": value for key, value in git.items()})
    return tags


def run_params() -> dict[str, str]:
    """Params beyond the spec: `versions.<library>` and the cluster shape."""
    params = {f"versions.{name}": v for name, v in library_versions().items()}
    params.update(cluster_shape())
    return params
