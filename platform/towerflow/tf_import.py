"""How every towerflow process imports TensorFlow: lean, quiet, and off the GPUs it does not use.

Every actor, every Ray Data parse worker and the driver is a process of its own that imports
TensorFlow first thing, so the import is part of every job's start-up and of every log.
- Lean: TensorFlow 2.21 loads all of Keras, and Keras imports scikit-learn and matplotlib where they
  are installed (MLflow installs both), for its scikit-learn wrappers and plotting helpers, doing
  without them where they are not. No towerflow process uses either, and they are a third of the
  import (1.1 of 3.2 s of CPU here; docs/benchmarks.md). A process that builds no model (a shard,
  a read task) leaves Keras out too: TensorFlow loads it only for its own registrations, and
  tolerates its absence (2.4-2.5 s of CPU against 2.8-3.5, 84 MB less peak memory, per process
  here). What is left out stays importable afterwards.
- Quiet: TensorFlow's C++ side logs through abseil, which writes to stderr and ignores
  TF_CPP_MIN_LOG_LEVEL until it is initialised, which it is not while TensorFlow loads (upstream:
  abseil/abseil-cpp#1718). Those early lines below the level are dropped here; the rest pass.
- Off the GPUs: a process that uses no GPU (the driver, a shard, a parse worker) hides them from
  TensorFlow. The driver writes checkpoints with TensorFlow while the workers train: on a GPU node,
  TensorFlow would otherwise reserve most of each GPU's memory for it, under the workers' feet.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

UNUSED_WHILE_TENSORFLOW_LOADS = ("sklearn", "matplotlib")
DEFAULT_MIN_LOG_LEVEL = "2"  # INFO and WARNING lines of TensorFlow's C++ side are not shown

# abseil's line format before it is initialised: severity, a zero date, time, thread, file:line]
_EARLY_LOG_LINE = re.compile(r"^([IWEF])0000 00:00:\S+\s+\d+ \S+:\d+\] ")
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# Lines of a multi-line message that follow its first line (cpu_feature_guard's instruction list).
_CONTINUATIONS = ("To enable the following instructions:",)


def import_tensorflow(*, gpus: bool = True, keras: bool = True) -> ModuleType:
    """TensorFlow, imported as the module docstring says; `gpus=False` hides every GPU from it,
    `keras=False` leaves Keras out (for a process that builds no model: a later `import keras`
    works, but then loads scikit-learn and matplotlib with it).

    Where this process has imported TensorFlow already, it is returned as it is; Keras, wanted now
    and left out before, is imported lean.
    """
    if "tensorflow" in sys.modules:
        if keras and "keras" not in sys.modules:
            with _refused(UNUSED_WHILE_TENSORFLOW_LOADS):
                import keras  # noqa: F401
        return sys.modules["tensorflow"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", DEFAULT_MIN_LOG_LEVEL)
    left_out = UNUSED_WHILE_TENSORFLOW_LOADS + (() if keras else ("keras",))
    with _early_log_filtered(gpus), _refused(left_out):
        import tensorflow as tf

        if not gpus:
            tf.config.set_visible_devices([], "GPU")  # probes CUDA, which logs: inside the filter
    return tf


def kept_early_log(text: str, min_level: int, gpus: bool = True) -> str:
    """What of TensorFlow's early stderr to show: its C++ log lines at `min_level` and above (for a
    process without GPUs, not CUDA's failure to initialise either), and every other line."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        found = _EARLY_LOG_LINE.match(line)
        if found:
            dropping = _SEVERITY[found.group(1)] < min_level or (not gpus and "cuInit" in line)
        elif line.startswith(_ABSL_BANNER):
            dropping = min_level > _SEVERITY["W"]
        elif not (dropping and line.startswith(_CONTINUATIONS)):
            dropping = False
        if not dropping:
            kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def _early_log_filtered(gpus: bool) -> Iterator[None]:
    """Route this process's stderr (the file descriptor, which C++ writes to) through
    kept_early_log() for the block."""
    try:
        min_level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        min_level = 0
    with contextlib.ExitStack() as stack:
        try:
            captured = stack.enter_context(tempfile.TemporaryFile())
            saved = os.dup(2)
        except OSError:  # no writable temporary folder, or no stderr: let the lines through
            captured = None
        if captured is None:
            yield
            return
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = kept_early_log(captured.read().decode(errors="replace"), min_level, gpus)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


class _Refuse(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes importing any module of these packages fail as if they were not installed.

    The package is still found where it is (TensorFlow asks where Keras lies with
    `importlib.util.find_spec` while it loads, and cannot take an error there); loading it fails.
    """

    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages = packages

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in self.packages:
            return None
        found = importlib.machinery.PathFinder.find_spec(name, path)
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(
            name, self, origin=found.origin, is_package=found.submodule_search_locations is not None
        )

    def exec_module(self, module) -> None:
        name = module.__name__
        raise ModuleNotFoundError(f"No module named {name!r} (not loaded with TensorFlow)", name=name)


@contextlib.contextmanager
def _refused(packages: tuple[str, ...]) -> Iterator[None]:
    finder = _Refuse(packages)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
