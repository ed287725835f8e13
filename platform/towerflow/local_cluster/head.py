"""A Ray head on this machine for the cluster path: token authentication on, every server on
127.0.0.1, the dashboard's job server for `ray job submit` and `towerflow submit`.

It runs as `ray start --head --block`, the leader of a process group of its own: stopping that
process stops everything it started. It never uses `ray stop`, which stops every Ray on the
machine. Its temp dir is its own, under /tmp (Ray's socket paths must stay under 107 bytes).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from towerflow.local_cluster.processes import (
    ProcessRef,
    ServerError,
    free_ports,
    http_json,
    log_tail,
    start_detached,
    stop_tree,
    wait_until,
)
from towerflow.runtime.cluster import AUTH_MODE, RAY_NODE_ENV, SINGLE_MACHINE_SWITCH

DEFAULT_NUM_CPUS = 8  # logical CPUs: the example's workers, shards and Ray Data tasks fit on a small machine
# `ray start` waits a fixed 30 s for its raylet to register with the GCS, then stops what it started
# and exits saying this. A small machine busy starting the tracking server beside the head can miss
# that wait; such a head is started again (fresh ports and temp dir) while the start's time lasts.
RAY_GAVE_UP_REGISTERING = "The current node timed out during startup"
TEMP_DIR_PREFIX = "tfcluster-"  # of a head's temp dir under /tmp, which its processes' command lines name
_log = logging.getLogger(__name__)


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
    launch = partial(
        launch_head, token=token, log_path=log_path, num_cpus=num_cpus, worker_ports=worker_ports, env=env
    )
    head, process = launch()
    return wait_for_head(head, process, token, timeout_s, relaunch=launch)


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
    temp_dir = Path(tempfile.mkdtemp(prefix=TEMP_DIR_PREFIX, dir="/tmp"))
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


def wait_for_head(
    head: RayHead,
    process: subprocess.Popen,
    token: str,
    timeout_s: float = 120.0,
    relaunch: Callable[[], tuple[RayHead, subprocess.Popen]] | None = None,
) -> RayHead:
    """Return `head` once the GCS lists its node alive to a caller with the token; stop it and
    raise if it does not. A head whose `ray start` gave up on its raylet's registration is started
    again by `relaunch` while `timeout_s` lasts; the head returned is then the new one."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            wait_until(
                partial(_head_node_alive, head, token),
                process=process,
                what=f"the Ray head (dashboard {head.dashboard_url})",
                log_path=head.log_path,
                timeout_s=max(1.0, deadline - time.monotonic()),
            )
            return head
        except BaseException as exc:
            head.stop()
            gave_up = isinstance(exc, ServerError) and _gave_up_registering(process, head)
            if relaunch is None or not gave_up or time.monotonic() >= deadline:
                raise
        _log.warning(
            "the Ray head's raylet did not register within `ray start`'s 30 s (a busy machine); "
            "starting the head again"
        )
        head, process = relaunch()


def _head_node_alive(head: RayHead, token: str) -> bool:
    """Whether the GCS lists the head's node ALIVE: its raylet has registered, so a job can start
    (the dashboard answers seconds before that, and a raylet that never registers ends the head
    after `ray start`'s 30 s)."""
    reply = http_json(f"{head.dashboard_url}/api/v0/nodes?limit=10", {"Authorization": f"Bearer {token}"})
    nodes = (((reply or {}).get("data") or {}).get("result") or {}).get("result") or []
    return any(node.get("state") == "ALIVE" for node in nodes)


def _gave_up_registering(process: subprocess.Popen, head: RayHead) -> bool:
    return process.poll() is not None and RAY_GAVE_UP_REGISTERING in log_tail(head.log_path)


def stop_head(process: ProcessRef, temp_dir: Path | None, timeout_s: float = 60.0) -> bool:
    """Stop a head (`ray start --block` stops its raylet, GCS and workers on SIGTERM) and remove its
    temp dir. Returns whether it was running. The signal goes to `ray start` alone: it stops the
    raylet before the GCS, whereas a GCS signalled beside its raylet waits ~30 s to exit."""
    stopped = stop_tree(process, timeout_s, whole_group=False)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return stopped
