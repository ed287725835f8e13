"""The pool of warm spares (runtime/spares.py) on the session's Ray, with actors that cannot start:
the pool stops making them. Spares of the run's own actors, taken and made good: test_shard_group.py
and test_faults.py."""

from __future__ import annotations

import logging
import time

import pytest
import ray

from towerflow.runtime.spares import MAX_FAILED_STARTS, SparePool

pytestmark = pytest.mark.timeout(120)


@ray.remote(num_cpus=0)
class DiesAsItStarts:
    def __init__(self) -> None:
        raise RuntimeError("this node cannot start one")


def test_spares_that_die_as_they_start_are_made_again_only_so_often(ray_cluster, caplog):
    made = []

    def make(bundle: int):
        made.append(bundle)
        return DiesAsItStarts.remote()

    pool = SparePool(make, "probe", answer_timeout_s=5.0)
    pool.start([3])
    with caplog.at_level(logging.INFO, logger="towerflow.runtime.spares"):
        deadline = time.monotonic() + 60
        while (pool.spares or len(made) < MAX_FAILED_STARTS) and time.monotonic() < deadline:
            pool.refill()  # the driver's every turn
            time.sleep(0.1)
        settled = time.monotonic() + 2  # and no more after that
        while time.monotonic() < settled:
            pool.refill()
            time.sleep(0.1)
    assert made == [3] * MAX_FAILED_STARTS and pool.spares == []
    assert caplog.text.count("a spare probe was lost while it waited") == MAX_FAILED_STARTS - 1
    assert f"{MAX_FAILED_STARTS} spare probes died before they started" in caplog.text
    assert "(the last: RuntimeError: this node cannot start one)" in caplog.text
