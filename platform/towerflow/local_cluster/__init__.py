"""A local stand-in for the cluster path, all on 127.0.0.1: a real PostgreSQL, an MLflow tracking
server on it (basic-auth, proxied artifacts) and a Ray head with token authentication.

`cluster_up`/`cluster_down`/`cluster_status` are `towerflow cluster up|down|status`; tests start
the parts on their own (`start_postgres`, `start_tracking_server`, `start_head`).
"""

from towerflow.local_cluster.cluster import (
    ClusterState,
    cluster_down,
    cluster_status,
    cluster_up,
    default_state_dir,
)
from towerflow.local_cluster.head import RayHead, start_head
from towerflow.local_cluster.postgres import PostgresServer, data_dir_for, start_postgres, stop_postgres
from towerflow.local_cluster.processes import ServerError
from towerflow.local_cluster.tracking_server import TrackingServer, auth_header, start_tracking_server

__all__ = [
    "ClusterState",
    "PostgresServer",
    "RayHead",
    "ServerError",
    "TrackingServer",
    "auth_header",
    "cluster_down",
    "cluster_status",
    "cluster_up",
    "data_dir_for",
    "default_state_dir",
    "start_head",
    "start_postgres",
    "start_tracking_server",
    "stop_postgres",
]
