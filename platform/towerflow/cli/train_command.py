"""`towerflow train` and `towerflow compare`: the commands that run training jobs (parse, call, print)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from functools import partial
from pathlib import Path

from towerflow.cli.driver_restarts import (
    is_restarted_driver,
    is_supervised_child,
    note_run_id,
    restarts_wanted,
    supervise_driver,
)
from towerflow.cli.options import add_overrides_option, runnable
from towerflow.messages import say
from towerflow.runtime.hooks import Hook, SessionInfo
from towerflow.runtime.signals import interrupt_on_sigterm
from towerflow.tracking.ui import DEFAULT_HOST, DEFAULT_PORT, is_tracking_server, run_page_url


def add_train_commands(sub) -> None:
    """`towerflow train` and `towerflow compare` under the CLI's subcommands."""
    train = sub.add_parser("train", help="run a training job from a YAML spec")
    train.add_argument("spec", type=Path, help="job spec (YAML), e.g. pipelines/mnist_sync.yaml")
    add_overrides_option(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    train.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue this MLflow run from its latest checkpoint (any number of PS shards); "
        "auto: the newest unfinished run of this job if there is one (what a retried job runs)",
    )
    train.set_defaults(handler=_train)

    compare = sub.add_parser(
        "compare", help="train a spec in several modes as child runs of one MLflow run, with plots"
    )
    compare.add_argument("spec", type=Path, help="job spec (YAML)")
    compare.add_argument("--modes", default="sync,async", help="comma-separated modes (default sync,async)")
    add_overrides_option(compare)
    compare.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    compare.set_defaults(handler=_compare)


def _train(args: argparse.Namespace) -> int:
    from towerflow.cli.progress import ProgressHook
    from towerflow.launch import train
    from towerflow.runtime.actor_pool import KEPT_ACTORS
    from towerflow.spec import load_spec

    KEPT_ACTORS.keeping = False  # one run, then the process ends: its actors end with the run
    interrupt_on_sigterm()  # stopped as its run starts, the run ends KILLED (the driver's run: noted)
    spec = load_spec(args.spec, args.overrides)
    restarts = restarts_wanted(spec.training.failure.driver_restarts)
    if restarts and not is_supervised_child():
        return supervise_driver(partial(_driver_command, args), restarts, args.resume)
    run = _RunIdHook()
    hooks = [run] if args.no_progress else [run, ProgressHook(spec.training.max_steps)]
    try:
        # A driver started again resumes its run, or starts it over where there is nothing to resume.
        nothing_to_resume = "start_over" if is_restarted_driver() else "fail"
        result = train(spec, hooks=hooks, resume=args.resume, if_nothing_to_resume=nothing_to_resume)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run ended KILLED; say how to go on with it
        if run.run_id:
            say(
                f"towerflow: run {run.run_id} stopped (KILLED in MLflow); to go on from its latest "
                f"checkpoint: {_resume_command(args, run.run_id)}",
                stream=sys.stderr,
            )
        raise
    say(f"towerflow: {result.summary_line()}")
    if run.run_id:
        say(f"towerflow: {_where_to_see(run.tags['tracking_uri'], run.tags['experiment_id'], run.run_id)}")
    return 0


def _where_to_see(store: str, experiment_id: str, run_id: str) -> str:
    """How to open a run's page: at the tracking server that serves it, else in `towerflow ui`
    over its store (`--store` left out where the shell's MLFLOW_TRACKING_URI names it already)."""
    if is_tracking_server(store):
        return f"open it at {run_page_url(store, experiment_id, run_id)}"
    store_option = [] if store == os.environ.get("MLFLOW_TRACKING_URI") else ["--store", store]
    command = shlex.join([runnable("towerflow"), "ui", *store_option])
    page = run_page_url(f"http://{DEFAULT_HOST}:{DEFAULT_PORT}", experiment_id, run_id)
    return f"browse it with: {command}  (then open {page})"


def _driver_command(args: argparse.Namespace, resume: str | None) -> list[str]:
    """This train command, as the child that runs the driver (`training.failure.driver_restarts`)."""
    overrides = ["--set", *args.overrides] if args.overrides else []
    progress = ["--no-progress"] if args.no_progress else []
    resuming = ["--resume", resume] if resume else []
    return [sys.executable, "-m", "towerflow", "train", str(args.spec), *overrides, *progress, *resuming]


def _resume_command(args: argparse.Namespace, run_id: str) -> str:
    """This train command again, resuming `run_id`, started as this one was: a Ray job runs
    `python -m towerflow`, a shell the console script."""
    module = Path(sys.argv[0]).name == "__main__.py"
    program = ["python", "-m", "towerflow"] if module else [runnable("towerflow")]
    overrides = ["--set", *args.overrides] if args.overrides else []
    return shlex.join([*program, "train", str(args.spec), *overrides, "--resume", run_id])


class _RunIdHook(Hook):
    """Keeps the MLflow run id, and the tags that place it, that the tracker (the first hook) put in
    the session's tags."""

    run_id: str | None = None
    tags: dict[str, str]

    def begin(self, session: SessionInfo) -> None:
        self.tags = dict(session.tags)
        self.run_id = session.tags.get("run_id")
        if self.run_id:
            # Noted before it is printed: a driver killed once the line is out (by a user or a
            # test that waits for it) is started again on this run, not a new one.
            note_run_id(self.run_id)
            # for `towerflow scale`, and for `towerflow submit` to find in the job's log
            say(f"towerflow: MLflow run {self.run_id}")


def _compare(args: argparse.Namespace) -> int:
    from towerflow.cli.progress import ProgressHook
    from towerflow.compare import compare_modes, parse_modes, spec_for_mode

    interrupt_on_sigterm()  # stopped between its modes, the comparison ends KILLED
    modes = parse_modes(args.modes)
    # as the comparison's first run has it: an async-only setting is no error for a sync spec here
    spec = spec_for_mode(args.spec, modes[0], args.overrides)
    hooks = [] if args.no_progress else [ProgressHook(spec.training.max_steps)]
    comparison = compare_modes(args.spec, modes, overrides=args.overrides, hooks=hooks)
    for mode, result in comparison.results.items():
        say(f"towerflow: {mode}: {result.summary_line()}")
    say(
        f"towerflow: compared in run {comparison.parent_run_id} ({', '.join(comparison.plots)}); "
        + _where_to_see(comparison.tracking_uri, comparison.experiment_id, comparison.parent_run_id)
    )
    return 0
