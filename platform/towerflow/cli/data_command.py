"""`towerflow data synth`: write a synthetic data set (parse, call, print)."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
from pathlib import Path

from towerflow.errors import SpecError, TowerflowError

# Options that apply to one generator only: option (as the generators name it) -> data set.
_SYNTH_OPTIONS = {
    "vocab_size": "ptb",
    "num_classes": "tabular",
    "num_categories": "tabular",
    "imbalance": "tabular",
}


def add_data_command(sub) -> None:
    """`towerflow data synth` under the CLI's subcommands."""
    data = sub.add_parser("data", help="data sets: generate synthetic ones")
    data_sub = data.add_subparsers(metavar="ACTION")
    synth = data_sub.add_parser("synth", help="write a synthetic data set as shards plus a manifest")
    synth.add_argument("kind", choices=["mnist", "ptb", "tabular"], help="which data set")
    synth.add_argument("--out", type=Path, required=True, help="output folder")
    synth.add_argument("--shards", type=int, default=8, help="train shards (default 8)")
    synth.add_argument(
        "--eval-shards", type=int, default=None, help="eval shards (default shards/4, at least 1)"
    )
    synth.add_argument(
        "--examples",
        type=int,
        default=None,
        help="train examples (default: mnist 60000, ptb 26000, tabular 50000)",
    )
    synth.add_argument(
        "--eval-examples", type=int, default=None, help="eval examples, 0 for none (default: 10000, ptb 2000)"
    )
    synth.add_argument("--format", choices=["tfrecord", "csv"], default="tfrecord")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--vocab-size", type=int, default=None, help="ptb: vocabulary size (default 10000)")
    synth.add_argument("--num-classes", type=int, default=None, help="tabular: classes (default 2)")
    synth.add_argument("--num-categories", type=int, default=None, help="tabular: categories (default 8)")
    synth.add_argument(
        "--imbalance",
        type=float,
        default=None,
        help="tabular: fraction of the minority (last) class, e.g. 0.1",
    )
    synth.add_argument("--no-progress", action="store_true", help="no progress bar")
    synth.set_defaults(handler=_synth)


def _synth(args: argparse.Namespace) -> int:
    from towerflow.data.synth import GENERATORS

    options = {
        "shards": args.shards,
        "eval_shards": args.eval_shards,
        "seed": args.seed,
        "fmt": args.format,
        "examples": args.examples,
        "eval_examples": args.eval_examples,
    }
    for name, kind in _SYNTH_OPTIONS.items():
        if getattr(args, name) is not None and kind != args.kind:
            raise SpecError(
                f"--{name.replace('_', '-')} applies to `data synth {kind}` only, not {args.kind}"
            )
        options[name] = getattr(args, name)
    options = {k: v for k, v in options.items() if v is not None}
    generate = GENERATORS[args.kind]
    defaults = inspect.signature(generate).parameters
    total = sum(options.get(k, defaults[k].default) for k in ("examples", "eval_examples"))
    try:
        with _generation_bar(args.kind, total, not args.no_progress) as progress:
            manifest = generate(args.out, progress=progress, **options)
    except OSError as exc:
        if exc.filename is None:  # not the file system refusing a path: a bug, keep the traceback
            raise
        raise TowerflowError(
            f"--out {os.fspath(args.out)}: cannot write {exc.filename}: {exc.strerror}"
        ) from None
    splits = ", ".join(
        f"{name}: {s['examples']} examples in {len(s['files'])} files"
        for name, s in manifest["splits"].items()
    )
    print(f"towerflow: wrote {args.kind} ({args.format}) to {os.fspath(args.out)} ({splits})")
    return 0


@contextlib.contextmanager
def _generation_bar(kind: str, total: int, enabled: bool):
    """A rich bar of examples written, on a terminal only; yields the generators' progress callback."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    columns = (TextColumn(f"{kind} examples"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(kind, total=total)
        yield lambda rows: bar.advance(task, rows)
