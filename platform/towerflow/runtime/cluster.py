"""Connect to the Ray cluster in RAY_ADDRESS, or start an embedded local one sized for the job.

Ray Data's read and parse tasks need CPU slots too: if the actors reserved every CPU, the data
pipeline could never be scheduled and training would hang. So the job's CPU budget counts the
actors *and* `cluster.data_cpus`, and an embedded Ray gets logical CPUs to cover it even on a
2-core machine (actors set their TensorFlow threads from their own share, so this is not
oversubscription of threads).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
from dataclasses import dataclass

from towerflow.errors import ClusterError
from towerflow.runtime.signals import take_sigterm_back_from_ray

log = logging.getLogger(__name__)

# Ray's switch for clusters of one machine: off, a Ray started here takes 127.0.0.1 as its node
# address, and then every one of its servers (GCS, raylet, workers) listens on 127.0.0.1 only.
SINGLE_MACHINE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE = "RAY_AUTH_MODE"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class ResourceBudget:
    worker_cpus: float
    ps_cpus: float
    data_cpus: float
    gpus: float

    @property
    def cpus(self) -> float:
        return self.worker_cpus + self.ps_cpus + self.data_cpus


def budget_for(cluster, workers: int | None = None) -> ResourceBudget:
    """`cluster` is the spec's ClusterSpec; `workers` (default cluster.workers) the workers to count,
    besides the spare workers."""
    workers = (cluster.workers if workers is None else workers) + cluster.spare_workers
    return ResourceBudget(
        worker_cpus=workers * cluster.cpus_per_worker,
        ps_cpus=cluster.shard_processes * cluster.cpus_per_ps,
        data_cpus=cluster.data_cpus,
        gpus=workers * cluster.gpus_per_worker,
    )


def keep_embedded_ray_local() -> None:
    """Make the Ray that this process may start listen on 127.0.0.1 only.

    Ray reads the switch when it is imported, so call this before anything imports Ray (the CLI
    does, first thing). It does nothing when RAY_ADDRESS names a cluster to join: joining needs this
    node's real address. A user's own setting of the switch (or of RAY_AUTH_MODE) wins.
    """
    if not os.environ.get("RAY_ADDRESS") and "ray" not in sys.modules:
        os.environ.setdefault(SINGLE_MACHINE_SWITCH, "0")
        # Token authentication, Ray's default for a new local cluster, chosen explicitly: Ray then
        # skips its start-up warning, which invites the user to opt out. (Ray reads it at import.)
        os.environ.setdefault(AUTH_MODE, "token")


# Ray kills a node's idle worker processes beyond its CPU count after 1 s. Where the job's actors fill
# a node's CPUs, every Ray Data read task then starts a new process that imports TensorFlow (3-4 s
# on 2 cores) instead of reusing the last one: 60 steps of a 3-worker run on 2-CPU test nodes took
# 88 s instead of 31. Every Ray node towerflow starts keeps idle workers for a minute: the embedded
# Ray through its system config, every other node through the environment of its `ray start`.
RAY_NODE_CONFIG = {"idle_worker_killing_time_threshold_ms": 60_000}
RAY_NODE_ENV = {f"RAY_{name}": str(value) for name, value in RAY_NODE_CONFIG.items()}


def machine_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


_started_here: set[str] = set()  # GCS addresses of the embedded Rays `ensure_ray` started in this process


def runs_on_embedded_ray() -> bool:
    """Whether a job here runs on this machine's own Ray: the one `ensure_ray` will start (no
    RAY_ADDRESS, none joined here yet), or the one it started in this process for an earlier job
    (`towerflow compare`'s second mode, a program training twice), not a cluster joined."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().gcs_address in _started_here
    return not os.environ.get("RAY_ADDRESS")


def ensure_ray(budget: ResourceBudget, needed: ResourceBudget | None = None) -> str:
    """Connect or start Ray (an embedded one sized for `budget`); check it can hold `needed` (default
    `budget`: an elastic job needs room for its fewest workers only). Returns 'connected' or 'embedded'."""
    import ray

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        join_cluster()
        how = "connected"
    else:
        cpus = max(machine_cores(), math.ceil(budget.cpus))
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            log_to_driver=False,  # actor logs stay in /tmp/ray/session_latest/logs; errors still reach us
            configure_logging=True,
            logging_level="WARNING",
            _system_config=RAY_NODE_CONFIG,
        )
        how = "embedded"
        take_sigterm_back_from_ray()
        _started_here.add(ray.get_runtime_context().gcs_address)
        host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
        if host not in _LOOPBACK:
            log.warning(
                "the embedded Ray listens on %s, not only 127.0.0.1 (token authentication is still "
                "on). Ray was imported before towerflow could keep it local: call "
                "towerflow.keep_ray_local() before importing Ray, set %s=0 in the environment, or use "
                "the towerflow command.",
                host,
                SINGLE_MACHINE_SWITCH,
            )
    check_capacity(needed or budget, ray.cluster_resources())
    return how


def join_cluster() -> None:
    """Connect to the Ray cluster in RAY_ADDRESS, unless this process is connected to one already."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ["RAY_ADDRESS"]
    check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=True)
    except Exception as exc:  # Ray raises several types here; all mean the same to the user
        raise ClusterError(
            f"cannot connect to the Ray cluster at RAY_ADDRESS={address}: {exc}. "
            "Check the address and, with token authentication, RAY_AUTH_MODE=token and the token."
        ) from None
    take_sigterm_back_from_ray()


def connect_existing() -> None:
    """Join the running cluster in RAY_ADDRESS, or the one started on this machine; never start one."""
    import ray

    address = os.environ.get("RAY_ADDRESS", "auto")
    check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except ConnectionError as exc:
        raise ClusterError(
            f"no Ray cluster to reach (RAY_ADDRESS={address}): {str(exc).rstrip('.')}. Set RAY_ADDRESS to the job's cluster."
        ) from None


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail fast where nothing listens at a host:port RAY_ADDRESS: ray.init retries one for ever.
    Ray Client (ray://) and auto-detection addresses are left to Ray."""
    if "://" in address or address in ("auto", "local"):
        return
    from ray._private.services import canonicalize_bootstrap_address  # how ray.init reads it

    try:
        target = canonicalize_bootstrap_address(address)
    except ValueError as exc:
        raise ClusterError(f"RAY_ADDRESS={address} is not a host:port address: {exc}") from None
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except OSError as exc:
        why = f"{exc.strerror or exc}"
    hint = ""
    if target != address:
        hint = f" (Ray resolves it to {target}"
        if address.rpartition(":")[0] in _LOOPBACK:
            hint += (
                f"; to reach a head that listens on 127.0.0.1 only, set {SINGLE_MACHINE_SWITCH}=0 here too"
            )
        hint += ")"
    raise ClusterError(
        f"no Ray cluster answers at RAY_ADDRESS={address}{hint}: {why}. Start one (`ray start --head`), "
        "fix RAY_ADDRESS, or unset it to train on an embedded local Ray."
    )


def live_node_resources() -> list[dict[str, float]]:
    """Each live node's total resources (Ray's `ray.nodes()`)."""
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def check_actors_fit_nodes(cluster, nodes: list[dict[str, float]]) -> None:
    """Fail up front where one worker or shard needs more than any single node has: Ray would leave
    it pending for ever, though the cluster's total looks big enough. `cluster` is the ClusterSpec."""
    needs = {
        "worker": (
            {"CPU": cluster.cpus_per_worker, "GPU": cluster.gpus_per_worker},
            "cluster.cpus_per_worker / gpus_per_worker",
        ),
        "parameter server": ({"CPU": cluster.cpus_per_ps}, "cluster.cpus_per_ps"),
    }
    for actor, (wanted, keys) in needs.items():
        if any(
            all(node.get(r, 0.0) + 1e-9 >= amount for r, amount in wanted.items() if amount) for node in nodes
        ):
            continue
        asked = ", ".join(f"{amount:g} {r}" for r, amount in wanted.items() if amount)
        biggest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
        raise ClusterError(
            f"a {actor} asks for {asked} ({keys}), more than any node of the Ray cluster has (the largest: "
            f"{biggest.get('CPU', 0.0):g} CPU, {biggest.get('GPU', 0.0):g} GPU over {len(nodes)} node(s)); it "
            "would wait for ever. Lower it, or add a node that big."
        )


def check_capacity(budget: ResourceBudget, resources: dict[str, float]) -> None:
    have_cpu, have_gpu = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if have_cpu + 1e-9 < budget.cpus:
        raise ClusterError(
            f"the Ray cluster has {have_cpu:g} CPUs but the job needs {budget.cpus:g}: "
            f"{budget.worker_cpus:g} for workers ((cluster.workers + spare_workers) x cluster.cpus_per_worker), "
            f"{budget.ps_cpus:g} for parameter servers ((cluster.ps + spare_shards) x cluster.cpus_per_ps) and "
            f"{budget.data_cpus:g} for Ray Data (cluster.data_cpus). Lower those or add nodes."
        )
    if have_gpu + 1e-9 < budget.gpus:
        raise ClusterError(
            f"the Ray cluster has {have_gpu:g} GPUs but the job asks for {budget.gpus:g} "
            "((cluster.workers + spare_workers) x cluster.gpus_per_worker); set cluster.gpus_per_worker: 0 to train on CPUs."
        )
