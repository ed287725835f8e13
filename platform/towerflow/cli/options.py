"""Options and helpers that several `towerflow` subcommands share."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from pathlib import Path


def add_overrides_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action=_OverridesAction,
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override spec keys, e.g. --set training.max_steps=200 cluster.workers=4 (repeatable)",
    )


class _OverridesAction(argparse.Action):
    """`--set` takes one or more KEY=VALUE and may repeat. A value without '=' is most likely the spec
    given after `--set`, which would otherwise be swallowed and reported as missing."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        for value in values:
            if "=" not in value:
                raise argparse.ArgumentError(
                    self, f"expected KEY=VALUE, got {value!r} (give the spec before --set)"
                )
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), *values])


def add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=None,
        metavar="URI",
        help="tracking store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )


def runnable(command: str) -> str:
    """`command` as this shell can run it: by name where it is on PATH, else by its path in this
    Python's environment (relative where it lies below the working directory, as .venv/bin/mlflow)."""
    if shutil.which(command):
        return command
    beside = Path(sys.executable).parent / command
    with contextlib.suppress(ValueError):
        return os.fspath(beside.relative_to(Path.cwd()))
    return os.fspath(beside)
