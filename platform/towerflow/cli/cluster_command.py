"""`towerflow cluster up|down|status|leave`: the CLI side of towerflow.local_cluster (parse, call, print)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path


def add_cluster_command(sub) -> None:
    """`towerflow cluster up|down|status|leave` under the CLI's subcommands."""
    cluster = sub.add_parser(
        "cluster",
        help="a local Ray head and an authenticated MLflow server on PostgreSQL, on 127.0.0.1",
        description=(
            "Try the cluster path on one machine: a Ray head (token authentication), PostgreSQL and an "
            "MLflow tracking server (basic-auth, proxied artifacts), all on 127.0.0.1. State, logs, "
            "generated secrets and data go to --state-dir (default TOWERFLOW_CLUSTER_DIR, else "
            "~/.towerflow/cluster)."
        ),
    )
    actions = cluster.add_subparsers(metavar="ACTION")
    up = actions.add_parser("up", help="start the head, PostgreSQL and the tracking server")
    up.add_argument("--num-cpus", type=float, default=None, help="the head's logical CPUs (default 8)")
    up.add_argument(
        "--worker-ports",
        type=_port_range,
        default=None,
        metavar="FIRST-LAST",
        help="the head's worker ports, apart from another Ray on this machine (default Ray's)",
    )
    down = actions.add_parser("down", help="stop them (data, logs and secrets stay for the next up)")
    status = actions.add_parser("status", help="what runs, and where")
    for action, handler in ((up, _cluster_up), (down, _cluster_down), (status, _cluster_status)):
        action.add_argument("--state-dir", type=Path, default=None, help="where the cluster's state lives")
        action.set_defaults(handler=handler)
    leave = actions.add_parser(
        "leave",
        help="this machine's Ray node leaves its cluster, draining first (a pod's preStop)",
        description=(
            "SIGTERM this machine's `ray start --block`, which drains its node for up to "
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S before it stops (a towerflow run keeps memory "
            "checkpoints every few seconds meanwhile), and wait until it has stopped. Any cluster's "
            "node, not only `cluster up`'s: k8s/ runs it as the Ray worker pods' preStop."
        ),
    )
    leave.add_argument(
        "--pid", type=int, default=None, help="the `ray start` process (default: this machine's)"
    )
    leave.set_defaults(handler=_cluster_leave)


def _port_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit() and 1024 <= int(first) < int(last) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r}: two ports FIRST-LAST, e.g. 21000-21099")
    return int(first), int(last)


def _cluster_up(args: argparse.Namespace) -> int:
    from towerflow.local_cluster import cluster_up

    state = cluster_up(args.state_dir, num_cpus=args.num_cpus, worker_ports=args.worker_ports)
    _print_cluster(state)
    print(f"towerflow: use it from a shell with: source {shlex.quote(str(state.env_file))}")
    print(state.env_file.read_text().rstrip())
    print(
        f"towerflow: the MLflow UI is {state.tracking_uri} (user {state.mlflow_username}, the password "
        "of MLFLOW_TRACKING_PASSWORD); stop everything with: towerflow cluster down"
    )
    return 0


def _cluster_down(args: argparse.Namespace) -> int:
    from towerflow.local_cluster import cluster_down

    stopped = cluster_down(args.state_dir)
    print(
        f"towerflow: stopped {', '.join(stopped)}" if stopped else "towerflow: no local cluster was running"
    )
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    from towerflow.local_cluster import cluster_status

    state = cluster_status(args.state_dir)
    if state is None:
        print("towerflow: no local cluster (towerflow cluster up starts one)")
        return 3
    _print_cluster(state)
    return 0 if all(state.running().values()) else 3


def _cluster_leave(args: argparse.Namespace) -> int:
    from towerflow.local_cluster.node_leave import leave_cluster

    print(f"towerflow: the Ray node stopped after {leave_cluster(args.pid):.1f} s", flush=True)
    return 0


def _print_cluster(state) -> None:
    """One line per server: whether it runs, where it listens, its log."""
    running, logs = state.running(), state.logs()
    where = {
        "ray": f"{state.ray_address} (jobs), GCS {state.ray_gcs_address}",
        "mlflow": f"{state.tracking_uri} (basic-auth), artifacts in {state.artifacts_dir}",
        "postgres": f"127.0.0.1:{state.postgres_port}, data in {state.postgres_data_dir}",
    }
    print(f"towerflow: local cluster in {state.state_dir}")
    for name, address in where.items():
        print(f"  {name:<9}{'running' if running[name] else 'stopped':<9}{address}; log {logs[name]}")
