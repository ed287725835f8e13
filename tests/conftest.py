"""Shared fixtures: one real Ray instance per test session, tiny real TFRecord data sets.

TensorFlow in this process gets two logical CPU devices before anything else touches it, so the
tower path can be compared against single-device math in-process.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.chdir(REPO)  # specs name models/ and pipelines/ by import string, as from the repository root
# Untracked runs (track=False without output_dir) write their checkpoints here, not into the repository.
os.environ.setdefault("TOWERFLOW_RUNS_DIR", tempfile.mkdtemp(prefix="towerflow-test-runs-"))
for entry in (str(REPO), str(REPO / "tests")):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from towerflow.runtime.cluster import keep_embedded_ray_local  # noqa: E402

keep_embedded_ray_local()  # the session's Ray listens on 127.0.0.1 only, as the CLI's does

from towerflow.tf_import import import_tensorflow  # noqa: E402

# As towerflow's processes import it: quiet (under pytest-xdist a worker's early C++ log lines would
# reach the terminal), and off the GPUs, which the tests' in-process towers do not use.
tf = import_tensorflow(gpus=False)
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.threading.set_intra_op_parallelism_threads(2)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session, with logical CPUs for several small jobs' actors."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def blob_data(tmp_path_factory) -> Path:
    """A tiny TFRecord data set (4 shards, 1,024 examples, 8 features) with a manifest."""
    from support import blobs, write_manifest, write_tfrecords

    folder = tmp_path_factory.mktemp("blobs")
    files = write_tfrecords(folder, "train", blobs(1024), shards=4)
    write_manifest(folder, "blobs", files, [256] * 4, dim=8)
    return folder


# Fixtures that start a Ray cluster of their own (tests/multinode.py's LocalCluster).
OWN_CLUSTER_FIXTURES = frozenset({"multinode_cluster", "gcs_ft_cluster", "ray_head"})


def _starts_own_cluster(item: pytest.Item) -> bool:
    return bool(OWN_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())))


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


PHASES = ("all", "embedded", "own-cluster")
# The embedded modules that take minutes (docs/testing.md), longest first.
LONGEST_FIRST = (
    "tests/runtime/test_faults.py",
    "tests/supervision/test_supervision.py",
    "tests/cli/test_cli.py",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=PHASES,
        default="all",
        help="run only the tests on the session's embedded Ray (`embedded`: `make test` runs them in "
        "two pytest-xdist workers) or only the modules that start a Ray cluster of their own "
        "(`own-cluster`: then, alone); default: all, in one process",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that start a Ray cluster of their own run last (in their order), after every
    test on the session's embedded Ray, which is then shut down (below): idle, it still takes a
    tenth of the 2-core machine (docs/testing.md), which these modules' three-node clusters need.
    So no test of such a module may ask for `ray_cluster`: it reaches its cluster from subprocesses.
    `--phase` keeps one side of that line (`make test` runs the two one after the other)."""
    own = {_module_of(item.nodeid) for item in items if _starts_own_cluster(item)}
    # stable: the order is kept otherwise, but for the longest embedded modules, which go first, so
    # that two workers (`--dist loadfile --no-loadscope-reorder`) end about together
    first = {module: rank for rank, module in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: (_module_of(item.nodeid) in own, first.get(_module_of(item.nodeid), len(first)))
    )
    phase = config.getoption("phase")
    if phase == "all":
        return
    kept, left = [], []
    for item in items:
        in_phase = (_module_of(item.nodeid) in own) == (phase == "own-cluster")
        (kept if in_phase else left).append(item)
    config.hook.pytest_deselected(items=left)
    items[:] = kept


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _starts_own_cluster(item):
        import ray

        if ray.is_initialized():
            ray.shutdown()


_FAILED = pytest.StashKey[bool]()  # a test's call failed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def _no_run_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test on a module's own cluster starts with the cluster whole: a node lost without a test
    asking is replaced first (its report printed). A failed test ends what it left running there,
    so that the module's next test does not fail too for want of the cores that run holds."""
    cluster = _modules_cluster(request)
    if cluster is not None:
        for report in cluster.heal():  # a warning: shown in the summary of a run that passes too
            warnings.warn(
                f"a node lost without a test asking, replaced before this test:\n{report}", stacklevel=1
            )
    yield
    if cluster is None or not request.node.stash.get(_FAILED, False):
        return
    from multinode_drivers import end_leftover_runs

    ended = end_leftover_runs(cluster)
    print(f"\nended what the failed test left on the cluster: {ended}")
    for report in cluster.unasked_losses():  # a node lost unasked, the likelier cause
        print(f"\na node lost without the test asking:\n{report}")


def _modules_cluster(request: pytest.FixtureRequest) -> Any:
    """The test module's own LocalCluster (tests/multinode.py), if the test uses one."""
    name = next((n for n in ("multinode_cluster", "gcs_ft_cluster") if n in request.fixturenames), None)
    return None if name is None else request.getfixturevalue(name)


_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each module's setup, call and teardown time, for the summary below."""
    module = _module_of(report.nodeid)
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


SUITE_LIMIT_S = 35 * 60  # the whole suite, on the 2-core CI machine
# When the suite started (seconds since the epoch): `make test` sets it for both its phases.
SUITE_STARTED_ENV = "TOWERFLOW_SUITE_STARTED"
_started = time.time()  # replaced as the session starts


def pytest_sessionstart(session: pytest.Session) -> None:
    global _started
    _started = float(os.environ.get(SUITE_STARTED_ENV) or time.time())


def pytest_terminal_summary(terminalreporter) -> None:
    """The slowest modules: where the suite's minutes go; and, where the suite's time so far comes
    near its limit (35 minutes on 2 cores), a line that says so. The modules' time adds up to more
    than the suite's where two workers run them side by side."""
    if not _module_seconds:
        return
    terminalreporter.section("slowest modules")
    for module, seconds in sorted(_module_seconds.items(), key=lambda kv: -kv[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
    took_s = time.time() - _started
    if took_s > 0.9 * SUITE_LIMIT_S:
        terminalreporter.write_line(
            f"the suite took {took_s / 60:.1f} of its {SUITE_LIMIT_S // 60} minutes (this session's "
            f"tests {sum(_module_seconds.values()) / 60:.1f}): make room before adding a slow test "
            "(docs/testing.md)",
            yellow=True,
        )
