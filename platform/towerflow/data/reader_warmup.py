"""Have a node's next read task start at once: a process there that has imported what reading takes.

A Ray Data read task runs in one of its node's pooled worker processes. On a node with none idle (one
that has just joined the cluster), the task first starts a process that imports TensorFlow: 4-5 s on
a loaded 2-core node, measured as most of the pause after an elastic grow, when every sync worker
waits for the new pipeline's first blocks. Ray gives an idle process to the job's next task on that
node, a read task among them, and the nodes towerflow starts keep one idle for a minute
(runtime/cluster.py RAY_NODE_CONFIG).
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0, max_retries=0)
def _warm(reader: Any) -> int:
    reader.warm()
    return os.getpid()


def warm_reader_process(reader: Any, node_id: str) -> ray.ObjectRef:
    """Start a process on `node_id` that imports what `reader` (a ShardReader) needs; the ref is
    done (the process's pid) once it has. It holds no CPU: it runs beside a node's actors."""
    return _warm.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
        reader
    )
