"""Whether the other nodes of the cluster see the data's local files, asked before any is read.

Ray Data runs a read task on whichever node has a free CPU, and a worker evaluates on its own node:
every node with CPUs must see the files at the paths the driver resolved. On a cluster without a
shared disk (the files copied to some nodes only) a read task on another node would fail mid-run,
or only once the driver's node is full; here the run fails at its start instead, naming the nodes
and files. Each node is asked by a task that holds no CPU (it runs beside the node's actors), in a
process the read tasks then reuse.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from towerflow.data.sources import is_local
from towerflow.errors import DataError

log = logging.getLogger(__name__)
ANSWER_TIMEOUT_S = 60.0  # a node that cannot start the task's process by then is not asked again


@dataclass(frozen=True)
class NodeView:
    """What one node sees of the files: its address, and the files it lacks."""

    node_id: str
    address: str
    missing: list[str]


@ray.remote(num_cpus=0, max_retries=0)
def _missing(files: list[str]) -> list[str]:
    return [path for path in files if not os.path.isfile(path.removeprefix("file://"))]


def check_every_node_sees(files: list[str], key: str) -> None:
    """Raise a DataError naming each node with CPUs (the driver's aside: it resolved the files) that
    lacks some of the local `files`. Nothing to ask without a Ray cluster of several nodes, or of
    files only on storage reached by URL (every node opens them alike)."""
    local = [path for path in files if is_local(path)]
    if not local or not ray.is_initialized():
        return
    here = ray.get_runtime_context().get_node_id()
    addresses = {
        n["NodeID"]: n["NodeManagerAddress"]
        for n in ray.nodes()
        if n["Alive"] and n["NodeID"] != here and n["Resources"].get("CPU", 0) > 0
    }
    on_node = {node: NodeAffinitySchedulingStrategy(node, soft=False) for node in addresses}
    asked = {_missing.options(scheduling_strategy=on_node[n]).remote(local): n for n in addresses}
    answered, silent = ray.wait(list(asked), num_returns=len(asked), timeout=ANSWER_TIMEOUT_S)
    views = []
    for ref in answered:
        node = asked[ref]
        try:
            views.append(NodeView(node, addresses[node], ray.get(ref)))
        except ray.exceptions.RayError as exc:  # a node lost meanwhile: Ray's and the run's concern
            log.info("could not ask node %s whether it sees %s: %s", node, key, exc)
    for ref in silent:
        log.warning("node %s did not say within %.0f s whether it sees %s", asked[ref], ANSWER_TIMEOUT_S, key)
        ray.cancel(ref, force=True)
    lacking = [view for view in views if view.missing]
    if lacking:
        raise DataError(_lacking_message(lacking, len(local), key))


def _lacking_message(lacking: list[NodeView], count: int, key: str) -> str:
    nodes = "; ".join(
        f"node {v.address} (Ray node {v.node_id[:12]}) lacks {len(v.missing)} of the {count} files, "
        f"e.g. {v.missing[0]}"
        for v in lacking[:3]
    )
    more = f"; and {len(lacking) - 3} more node(s)" if len(lacking) > 3 else ""
    return (
        f"{key}: {nodes}{more}. The driver's node has them, but Ray Data reads on any node with a free "
        "CPU: put the files where every node sees them at the same path (shared storage, the same "
        "copy on each node, or a URL such as s3://...; docs/cluster.md)"
    )
