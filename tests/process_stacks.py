"""What a hung process is doing: its Python threads' stacks (py-spy, which Ray's `default` extra
installs), and its children's, for a test's failure message where a driver or client outlived
its time limit (CI keeps only the output)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
from tracking_server import process_tree


def python_stacks(pid: int, timeout: float = 30) -> str:
    """The Python stacks of `pid` and its descendants, each process's under a header; a line that
    says why where one cannot be read."""
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        return "(no py-spy to read the stacks with)"
    dumps = []
    for process in process_tree(pid):
        try:
            read = subprocess.run(
                [py_spy, "dump", "--pid", str(process.pid)], capture_output=True, text=True, timeout=timeout
            )
            dumps.append(f"--- pid {process.pid}:\n{(read.stdout or read.stderr).strip()}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            dumps.append(f"--- pid {process.pid}: not read ({exc})")
    return "\n".join(dumps) or f"(pid {pid} is gone)"


def communicate_or_explain(command: subprocess.Popen, timeout: float, tail: int = 6000) -> str:
    """`command`'s output once it exits within `timeout`; otherwise its stacks and its output so far
    in an AssertionError, and it killed."""
    try:
        return command.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        stacks = python_stacks(command.pid)
        for process in process_tree(command.pid):
            with contextlib.suppress(psutil.Error):
                process.kill()
        out = command.communicate()[0] or ""
        raise AssertionError(
            f"{command.args!r} still ran after {timeout:.0f} s; its stacks:\n{stacks}\nits output:\n{out[-tail:]}"
        ) from None
