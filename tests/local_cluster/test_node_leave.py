"""`towerflow cluster leave`: which process is a node's `ray start`. Run for real, draining a node of
the multi-node cluster, in tests/runtime/test_multinode_draining.py (here it would stop this
machine's nodes)."""

from towerflow.local_cluster.node_leave import _runs_ray_start


def test_ray_start_is_known_by_its_arguments():
    assert _runs_ray_start(["python", "ray", "start", "--address=head:6379", "--block"])
    assert not _runs_ray_start(["python", "ray", "stop"])
    assert not _runs_ray_start(["sh", "-c", "ray start --block"])  # a shell that runs it: not it
