"""`towerflow submit`: a training job sent to a Ray cluster's job server with Ray's Job SDK.

The repository is the job's working directory (Ray leaves out what .gitignore names), the runtime
environment is `cluster/runtime_env.yaml` with this shell's MLFLOW_TRACKING_URI merged in, and the
entrypoint is the same `python -m towerflow train` a user would run, with `--resume auto` so that a
resubmission continues an unfinished run. Token authentication is Ray's: RAY_AUTH_MODE=token and
RAY_AUTH_TOKEN (or Ray's token file) in the environment.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from towerflow.errors import ClusterError, SpecError

RUNTIME_ENV_FILE = Path("cluster") / "runtime_env.yaml"
_RUN_LINE = re.compile(r"towerflow: MLflow run ([0-9a-f]{32})")


@dataclass(frozen=True)
class Submitted:
    job_id: str
    address: str  # the dashboard / job server

    def follow_command(self) -> str:
        return f"ray job logs -f --address {self.address} {self.job_id}"

    def stop_command(self) -> str:
        return f"ray job stop --address {self.address} {self.job_id}"


def job_server_address(address: str | None) -> str:
    """--address, else RAY_ADDRESS when it names a job server (http://HEAD:8265)."""
    found = address or os.environ.get("RAY_ADDRESS", "")
    if not found.startswith(("http://", "https://")):
        raise ClusterError(
            "towerflow submit needs the cluster's job server: --address http://HEAD:8265 (the Ray "
            "dashboard's address), or RAY_ADDRESS set to it"
            + (f"; RAY_ADDRESS={found} is a GCS address, which jobs are not submitted to" if found else "")
        )
    return found


def runtime_env(root: Path, tracking_uri: str | None = None) -> dict[str, Any]:
    """cluster/runtime_env.yaml (if the repository has one), the repository as working directory,
    and `tracking_uri` (default: this shell's MLFLOW_TRACKING_URI), so the job tracks where the user
    looks. Where the cluster's pods reach the server by another address than this shell (a
    port-forward), give that address, or unset the variable to keep the pods' own."""
    path = root / RUNTIME_ENV_FILE
    env: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise SpecError(f"{path}: not a readable YAML file: {exc}") from None
        if not isinstance(loaded, dict):
            raise SpecError(f"{path}: a runtime environment is a mapping (working_dir, env_vars, ...)")
        env = loaded
    env = {**env, "working_dir": str(root)}
    env_vars = dict(env.get("env_vars") or {})
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if tracking_uri:
        env_vars["MLFLOW_TRACKING_URI"] = tracking_uri
    if env_vars:
        env["env_vars"] = env_vars
    return env


def entrypoint(spec: Path, overrides: Sequence[str]) -> str:
    """`train --resume auto`, with its progress lines (a job's log is no terminal: a line every 10 s)."""
    args = ["python", "-m", "towerflow", "train", spec.as_posix(), "--resume", "auto"]
    for override in overrides:
        args += ["--set", override]
    return shlex.join(args)


def submit(
    spec: Path,
    *,
    address: str | None = None,
    overrides: Sequence[str] = (),
    tracking_uri: str | None = None,
    root: Path | None = None,
) -> Submitted:
    """Check the spec here, then submit its training job; returns the job's id and server."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    from towerflow.spec import load_spec

    root = (root or Path.cwd()).resolve()
    load_spec(spec, overrides)  # a bad spec fails here, naming the key, not minutes later in the job
    if not spec.resolve().is_relative_to(root):
        raise SpecError(
            f"{spec}: the spec must lie in the working directory ({root}), which is shipped to the job"
        )
    relative = spec.resolve().relative_to(root)
    server = job_server_address(address)
    try:
        client = JobSubmissionClient(server)
        job_id = client.submit_job(
            entrypoint=entrypoint(relative, overrides), runtime_env=runtime_env(root, tracking_uri)
        )
    except AuthenticationError:
        raise ClusterError(
            f"the job server at {server} refused this shell's Ray token: set RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN to the cluster's token (for `towerflow cluster up`'s, source its env.sh; "
            "on Kubernetes, the Secret the RayCluster's authOptions name)"
        ) from None
    except (
        ConnectionError,
        RuntimeError,
    ) as exc:  # Ray's SDK raises these for an unreachable or refusing server
        raise ClusterError(f"the job server at {server} did not take the job: {exc}") from None
    return Submitted(job_id, server)


def follow(submitted: Submitted, on_line: Callable[[str], None], on_run_id: Callable[[str], None]) -> str:
    """Stream the job's log to `on_line` until it ends (telling `on_run_id` the MLflow run id once the
    log names it); returns the job's final status."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(submitted.address)
    seen_run = False

    async def tail() -> None:
        nonlocal seen_run
        async for chunk in client.tail_job_logs(submitted.job_id):
            for line in chunk.splitlines():
                on_line(line)
                found = _RUN_LINE.search(line)
                if found and not seen_run:
                    seen_run = True
                    on_run_id(found.group(1))

    try:
        asyncio.run(tail())
        return client.get_job_status(submitted.job_id).value
    except (ConnectionError, RuntimeError) as exc:  # the job server restarted, or the network dropped
        raise ClusterError(
            f"lost job {submitted.job_id}'s log ({exc}); the job goes on: follow it again with "
            f"`{submitted.follow_command()}`, stop it with `{submitted.stop_command()}`"
        ) from None
