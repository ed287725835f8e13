"""A process known by its pid and start time (process_ref.py), on real processes: matched by the
kernel's tick count from boot, which a step of the wall clock does not move."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import psutil

from towerflow.process_ref import ProcessRef, started_since_boot


def test_a_process_is_known_by_its_kernel_start_whatever_the_wall_clock_says():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ref = ProcessRef.of(process.pid)
        wall = psutil.Process(process.pid).create_time()
        assert ref.since_boot == started_since_boot(process.pid) and ref.since_boot is not None
        assert abs((wall - psutil.boot_time()) - ref.since_boot) <= 1.0  # btime is whole seconds
        assert ref.is_running()
        # A wall-clock start read before a step of the clock (a VM's time sync moved the boot
        # time psutil adds to the kernel's count) still names the same process ...
        assert dataclasses.replace(ref, create_time=ref.create_time - 3).is_running()
        # ... and a start a second off in the kernel's count names another.
        assert not dataclasses.replace(ref, since_boot=ref.since_boot + 1).is_running()
        # Where the kernel's count is not known (a ref written before it was kept), the wall clock,
        # with slack for a whole-second step of the boot time.
        legacy = ProcessRef(process.pid, wall)
        assert dataclasses.replace(legacy, create_time=wall + 1).is_running()
        assert not dataclasses.replace(legacy, create_time=wall + 5).is_running()
    finally:
        process.kill()
        process.wait()
    assert not ref.is_running()
