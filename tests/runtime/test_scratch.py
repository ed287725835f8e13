"""Each actor's temporary folder: real processes write into their own, a SIGKILLed one's is removed by
the next to start, a running one's is kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from towerflow.runtime.scratch import scratch_root, sweep

# Takes its own scratch folder under argv[1], writes a temporary file as autograph does (kept past
# the process), says where, and waits to be killed.
_ACTOR_LIKE = """
import sys, tempfile, time
from towerflow.runtime.scratch import use_own_scratch_dir
own = use_own_scratch_dir(sys.argv[1])
with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="__autograph_generated_file", delete=False) as f:
    f.write("x = 1\\n")
print(own, f.name, flush=True)
time.sleep(600)
"""


def _start(base: Path) -> tuple[subprocess.Popen, Path, Path]:
    process = subprocess.Popen(
        [sys.executable, "-c", _ACTOR_LIKE, str(base)], stdout=subprocess.PIPE, text=True
    )
    own, written = process.stdout.readline().split()
    return process, Path(own), Path(written)


def test_a_killed_processs_folder_is_removed_by_the_next_to_start_and_a_running_ones_kept(tmp_path):
    first, first_own, first_file = _start(tmp_path)
    running, running_own, _ = _start(tmp_path)
    try:
        assert first_file.parent == first_own and first_own.parent == scratch_root(str(tmp_path))
        assert first_own.name.startswith(f"{first.pid}-")
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert first_file.exists()  # nothing removes it at a SIGKILL
        (first_own.parent / "not-a-scratch-folder").mkdir()
        later, later_own, _ = _start(tmp_path)
        later.kill()
        later.wait()
        assert not first_own.exists()  # the next to start removed it
        assert running_own.exists() and later_own.exists()  # still running (or not yet swept)
        assert (first_own.parent / "not-a-scratch-folder").exists()  # not named as ours: left alone
        assert sweep(first_own.parent) == [later_own.name]
    finally:
        running.kill()
        running.wait()


def test_a_root_that_is_not_a_private_folder_of_this_users_is_not_used(tmp_path):
    root = scratch_root(str(tmp_path))
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # others may read and enter: not private
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, tempfile; from towerflow.runtime.scratch import use_own_scratch_dir; "
            "before = tempfile.gettempdir(); "
            "print(use_own_scratch_dir(sys.argv[1]), tempfile.gettempdir() == before)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == ["None", "True"], out.stdout + out.stderr
    assert "is not a private folder" in out.stderr
    assert list(root.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="a folder of another user's needs root to make")
def test_another_users_root_is_not_used(tmp_path):
    root = scratch_root(str(tmp_path))
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from towerflow.runtime.scratch import use_own_scratch_dir; "
            "print(use_own_scratch_dir(sys.argv[1]))",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "None", out.stdout + out.stderr
