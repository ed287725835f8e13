"""A Ray head on this machine for the cluster path: token authentication on, every server on
127.0.0.1, the dashboard's job server for `ray job submit` and `towerflow submit`.

It runs as `ray start --head --block`, the leader of a process group of its own: stopping that
process stops everything it started. It never uses `ray stop`, which stops every Ray on the
machine. Its temp dir is its own, under /tmp (Ray's socket paths must stay under 107 bytes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from towerflow.local_cluster.processes import (
    ProcessRef,
    free_ports,
    http_ok,
    start_detached,
    stop_tree,
    wait_until,
)
from towerflow.runtime.cluster import AUTH_MODE, RAY_NODE_ENV, SINGLE_MACHINE_SWITCH

DEFAULT_NUM_CPUS = 8  # logical CPUs: the example's workers, shards and Ray Data tasks fit on a small machine


@dataclass(frozen=True)
class RayHead:
    """A running head: its GCS (for `ray.init`, `towerflow scale`), its dashboard (job server)."""

    gcs_address: str
    dashboard_url: str
    temp_dir: Path
    log_path: Path
    process: ProcessRef

    def stop(self) -> bool:
        return stop_head(self.process, self.temp_dir)


def head_env(token: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the head and of its jobs: this one without its RAY_* and MLFLOW_* settings
    (a RAY_ADDRESS would make it join another cluster), token auth on, servers on 127.0.0.1, this
    Python's environment first on PATH (a job's `python` is this one), then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        RAY_AUTH_TOKEN=token,
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # stop at once, not after draining for up to 30 s
        **{AUTH_MODE: "token", SINGLE_MACHINE_SWITCH: "0"},
    )
    env.update(RAY_NODE_ENV)
    env.update(extra or {})
    return env


def start_head(
    *,
    token: str,
    log_path: Path,
    num_cpus: float | None = None,
    worker_ports: tuple[int, int] | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> RayHead:
    """Start the head and return once its job server answers with the token. `worker_ports`
    (first, last) keeps its workers apart from another Ray's on this machine; `env` goes to the
    head and every job on it (a tracking server's address and credentials, as a cluster's nodes
    get them from a Secret)."""
    head, process = launch_head(
        token=token, log_path=log_path, num_cpus=num_cpus, worker_ports=worker_ports, env=env
    )
    return wait_for_head(head, process, token, timeout_s)


def launch_head(
    *,
    token: str,
    log_path: Path,
    num_cpus: float | None = None,
    worker_ports: tuple[int, int] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[RayHead, subprocess.Popen]:
    """Start the head's process without waiting for it (`wait_for_head`), so that other servers can
    start meanwhile."""
    gcs, dashboard, agent, agent_grpc, client = free_ports(5)
    temp_dir = Path(tempfile.mkdtemp(prefix="tfcluster-", dir="/tmp"))
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block"]
    command += [f"--port={gcs}", f"--num-cpus={num_cpus or DEFAULT_NUM_CPUS:g}", "--include-dashboard=true"]
    command += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}"]
    command += [f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}"]
    command += [f"--ray-client-server-port={client}", f"--temp-dir={temp_dir}"]
    if worker_ports:
        command += [f"--min-worker-port={worker_ports[0]}", f"--max-worker-port={worker_ports[1]}"]
    process = start_detached(command, log_path=log_path, env=head_env(token, env))
    head = RayHead(
        f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}", temp_dir, log_path, ProcessRef.of(process.pid)
    )
    return head, process


def wait_for_head(head: RayHead, process: subprocess.Popen, token: str, timeout_s: float = 120.0) -> RayHead:
    """Return `head` once its job server answers with the token; stop it and raise if it does not."""
    try:
        wait_until(
            lambda: http_ok(f"{head.dashboard_url}/api/version", {"Authorization": f"Bearer {token}"}),
            process=process,
            what=f"the Ray head (dashboard {head.dashboard_url})",
            log_path=head.log_path,
            timeout_s=timeout_s,
        )
    except BaseException:
        head.stop()
        raise
    return head


def stop_head(process: ProcessRef, temp_dir: Path | None, timeout_s: float = 60.0) -> bool:
    """Stop a head (`ray start --block` stops its raylet, GCS and workers on SIGTERM) and remove its
    temp dir. Returns whether it was running."""
    stopped = stop_tree(process, timeout_s)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return stopped
