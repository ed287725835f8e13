"""Pieces every benchmark script shares: a timestamped log, the machine line, the MNIST data."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from towerflow.runtime.cluster import keep_embedded_ray_local

keep_embedded_ray_local()  # the Ray a benchmark starts listens on 127.0.0.1 only, as the CLI's does


def make_log(name: str) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return log


def machine() -> str:
    import psutil

    found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    cpu = found.group(1) if found else platform.processor() or "unknown CPU"
    ram = psutil.virtual_memory().total / (1 << 30)
    return f"{cpu}, {os.cpu_count()} cores, {ram:.1f} GiB RAM, Python {platform.python_version()}"


def source_revision(root: Path) -> str:
    """Which code a report came from: the commit, and whether tracked files differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except OSError:
        return "not a git checkout"
    if head.returncode != 0:
        return "not a git checkout"
    edits = len(changed.stdout.splitlines())
    return f"commit {head.stdout.strip()}, " + (f"{edits} tracked file(s) changed" if edits else "no changes")


def ensure_mnist(
    folder: Path,
    log: Callable[[str], None],
    *,
    shards: int = 8,
    examples: int = 60000,
    eval_examples: int = 10000,
) -> None:
    """Synthetic MNIST (by default 60,000 train, 10,000 eval examples, 8 shards) unless the folder has it."""
    if (folder / "manifest.json").is_file():
        return
    from towerflow.data.synth import synth_mnist

    log(f"generating synthetic MNIST into {folder}")
    synth_mnist(str(folder), shards=shards, examples=examples, eval_examples=eval_examples, seed=0)
