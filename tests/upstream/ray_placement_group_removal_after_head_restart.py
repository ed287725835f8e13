"""Reproduce a Ray GCS crash that towerflow meets and cannot avoid (docs/reliability.md, Left to do):
removing a placement group one of whose bundles Ray placed again, on a GCS started again from
Redis, beside another bundle of the group, takes the GCS down with

    Check failed: bundle_spec->NodeId() == expected_node_id All bundles in a
    RemovePlacementGroupBundles batch must target the same node

Seen on Ray 2.60 at the end of the head-loss test (tests/runtime/test_multinode_driver_loss.py),
which marks that one ending as an expected failure. Run this on a new Ray release before taking it,
and with the text below when reporting it upstream:

    .venv/bin/python tests/upstream/ray_placement_group_removal_after_head_restart.py

Steps, on this machine's local cluster (tests/multinode.py: every node its own `ray start`, the
GCS's tables in a real Redis): a head with no CPUs and two 2-CPU nodes; a detached 2-bundle SPREAD
group of 1 CPU a bundle (one bundle a node); SIGKILL one node; SIGKILL the head and start it again;
once Ray has placed the lost bundle again (on the surviving node, beside the other), remove the
group. `--no-restart` leaves the head alone: the control, which removes the group cleanly.

The last line says what happened: `ray_pg_removal_crash=present|absent ray=<version>`; the exit
code is 1 where the GCS went down, 0 where the removal was clean, 2 where the steps themselves
failed (the group never placed again, say).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the local cluster's helpers

from multinode import LocalCluster  # noqa: E402
from node_processes import RAY_GCS_REMOVAL_CHECK  # noqa: E402
from redis_store import RedisStore  # noqa: E402

GROUP = "towerflow-upstream-repro"

MAKE_GROUP = f"""
import ray
from ray.util.placement_group import placement_group
ray.init(namespace="repro")
group = placement_group([{{"CPU": 1}}, {{"CPU": 1}}], strategy="SPREAD", name="{GROUP}", lifetime="detached")
ray.get(group.ready(), timeout=60)
print(sorted(set(ray.util.placement_group_table(group)["bundles_to_node_id"].values())))
"""

# argv[1]: the lost node's id. Waits until Ray has placed the lost bundle elsewhere, then removes.
REMOVE_GROUP = f"""
import sys, time
import ray
from ray.util import placement_group_table
ray.init(namespace="repro")
group = ray.util.get_placement_group("{GROUP}")
for _ in range(90):
    table = placement_group_table(group)
    if table["state"] == "CREATED" and sys.argv[1] not in table["bundles_to_node_id"].values():
        break
    time.sleep(1)
else:
    print("the lost bundle was not placed again within 90 s:", table)
    sys.exit(2)
print("placed again:", sorted(table["bundles_to_node_id"].values()))
ray.util.remove_placement_group(group)
time.sleep(3)
print("after the removal:", placement_group_table(group)["state"])
"""


def _client(code: str, env: dict[str, str], *args: str, timeout: float = 150) -> int | None:
    """Run a Ray client; its exit code, or None where it hung (a GCS gone for good, say)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as timed_out:
        print("client hung; its output:", (timed_out.stdout or b"")[-800:])
        return None
    print(done.stdout.strip()[-800:] or done.stderr.strip()[-800:])
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-restart", action="store_true", help="the control: the head is not restarted")
    args = parser.parse_args()
    import ray

    with RedisStore() as redis, LocalCluster(head_cpus=0, node_cpus=(2, 2), gcs_store=redis) as cluster:
        env = cluster.env()
        if _client(MAKE_GROUP, env, timeout=120) != 0:
            print(f"ray_pg_removal_crash=unknown ray={ray.__version__}")
            return 2
        lost = cluster.nodes[1]
        cluster.kill_node(lost)
        if not args.no_restart:
            print(f"head back in {cluster.restart_head(down_s=5):.1f} s")
        removed = _client(REMOVE_GROUP, env, lost.node_id)
        time.sleep(3)
        alive, checked = cluster.head.process.poll() is None, cluster.head.gcs_said(RAY_GCS_REMOVAL_CHECK)
        print("the head alive:", alive, "| its GCS failed the check:", checked)
        crashed = not alive or checked
        if removed == 2:
            print(f"ray_pg_removal_crash=unknown ray={ray.__version__}")
            return 2
    print(f"ray_pg_removal_crash={'present' if crashed else 'absent'} ray={ray.__version__}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
