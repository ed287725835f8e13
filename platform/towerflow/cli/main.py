"""`towerflow` command line. Each subcommand parses its arguments and calls the public API."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import inspect
import logging
import os
import shlex
import shutil
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from towerflow.cli.cluster_command import add_cluster_command
from towerflow.errors import TowerflowError
from towerflow.runtime import signals
from towerflow.runtime.cluster import keep_embedded_ray_local
from towerflow.runtime.hooks import Hook, SessionInfo


def run() -> NoReturn:
    """The command (`towerflow`, `python -m towerflow`): `main`, the exit handlers, then the end of
    the process without the interpreter's teardown of TensorFlow's, Ray's and MLflow's modules, which
    took 1.5-2 s after the command's last word for nothing. A thread still running keeps the usual
    exit, which waits for it."""
    code = main()
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        raise SystemExit(code)
    atexit._run_exitfuncs()  # Ray's shutdown, logging's flush, temporary directories, ...
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    try:
        _working_directory_importable()
    except FileNotFoundError:
        print(
            "towerflow: error: the working directory no longer exists (deleted under this process: on a "
            "Ray node, another node's runtime-env agent cleaning a shared --temp-dir does this). Give "
            "each Ray node on a machine its own --temp-dir, and start the command again.",
            file=sys.stderr,
        )
        return 2
    keep_embedded_ray_local()  # before any subcommand imports Ray
    _show_library_messages()
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except TowerflowError as exc:
        _stop_forwarding_ray_logs()
        print(f"towerflow: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return _stopped()
    except Exception as exc:  # a bug, not a user error: keep the traceback, say what to do
        _stop_forwarding_ray_logs()
        traceback.print_exc()
        print(
            f"towerflow: internal error: {type(exc).__name__}: {exc}\n"
            "This is a bug in towerflow (or an unexpected environment); please report it with the traceback above.",
            file=sys.stderr,
        )
        return 1


def _stopped() -> int:
    """The last word and exit code of a command stopped by a signal: as a shell reports a process
    ended by SIGTERM (`ray job stop`, Kubernetes) or by Ctrl-C."""
    if signals.stopped_by_sigterm():
        print("towerflow: terminated (SIGTERM)", file=sys.stderr)
        return signals.EXIT_CODE
    print("towerflow: interrupted", file=sys.stderr)
    return 130


def _stop_forwarding_ray_logs() -> None:
    """Disconnect from Ray before the last word. Connected to a cluster, Ray's log thread prints
    actors' lines on stderr, each in two writes: one landing between them would glue the error to an
    actor's line, and late ones would bury it. Disconnecting joins that thread."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _show_library_messages() -> None:
    """towerflow's own log lines (a worker lost and replaced, a run resumed) on stderr, as the rest
    of what the command says; libraries log, the command decides how it looks."""
    logger = logging.getLogger("towerflow")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("towerflow: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _working_directory_importable() -> None:
    """Specs name models/ and pipelines/ by import string from the working directory, which Ray
    ships to the actors. `python -m towerflow` puts it on sys.path; the console script does not, so
    put it there too: the driver imports the model itself to export it."""
    cwd = os.getcwd()
    if not any(entry in ("", ".", cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towerflow", description="Parameter-server TensorFlow training on Ray."
    )
    sub = parser.add_subparsers(metavar="COMMAND")

    train = sub.add_parser("train", help="run a training job from a YAML spec")
    train.add_argument("spec", type=Path, help="job spec (YAML), e.g. pipelines/mnist_sync.yaml")
    _add_overrides_option(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    train.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue this MLflow run from its latest checkpoint (any number of PS shards); "
        "auto: the newest unfinished run of this job if there is one (what a retried job runs)",
    )
    train.set_defaults(handler=_train)

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

    ui = sub.add_parser("ui", help="start the MLflow UI over the run store, on 127.0.0.1")
    ui.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    ui.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    _add_store_option(ui)
    ui.set_defaults(handler=_ui)

    compare = sub.add_parser(
        "compare", help="train a spec in several modes as child runs of one MLflow run, with plots"
    )
    compare.add_argument("spec", type=Path, help="job spec (YAML)")
    compare.add_argument("--modes", default="sync,async", help="comma-separated modes (default sync,async)")
    _add_overrides_option(compare)
    compare.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    compare.set_defaults(handler=_compare)

    export = sub.add_parser(
        "export", help="export a run's latest checkpoint as a SavedModel, log and register it in MLflow"
    )
    export.add_argument("run_id", metavar="RUN_ID", help="the MLflow run (its spec.yaml and checkpoints/)")
    _add_store_option(export)
    export.set_defaults(handler=_export)

    gpus = sub.add_parser("gpus", help="list every GPU in the Ray cluster with the processes on it")
    gpus.set_defaults(handler=_gpus)

    submit = sub.add_parser(
        "submit",
        help="submit a training job to a Ray cluster's job server (this directory as its working directory)",
        description=(
            "Checks the spec here, then submits `python -m towerflow train SPEC --resume auto` with "
            "cluster/runtime_env.yaml and this shell's MLFLOW_TRACKING_URI. Token authentication: "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in the environment."
        ),
    )
    submit.add_argument("spec", type=Path, help="job spec (YAML), inside this directory")
    submit.add_argument("--address", help="the job server, http://HEAD:8265 (default: RAY_ADDRESS)")
    submit.add_argument(
        "--tracking-uri",
        help="the MLflow server as the cluster's nodes reach it (default: this shell's MLFLOW_TRACKING_URI)",
    )
    _add_overrides_option(submit)
    submit.add_argument("--no-wait", action="store_true", help="return once submitted; do not follow the log")
    submit.set_defaults(handler=_submit)

    scale = sub.add_parser(
        "scale",
        help="set a running job's worker count: it grows as the cluster has room, or shrinks now",
        description="Reaches the job through the Ray cluster in RAY_ADDRESS (default: the one on this machine).",
    )
    scale.add_argument("run_id", metavar="RUN_ID", help="the job's MLflow run id")
    scale.add_argument("--workers", type=_at_least_one, required=True, metavar="K", help="workers wanted")
    scale.set_defaults(handler=_scale)

    add_cluster_command(sub)
    return parser


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return int(text)


def _add_overrides_option(parser: argparse.ArgumentParser) -> None:
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


def _add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=None,
        metavar="URI",
        help="tracking store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )


def _train(args: argparse.Namespace) -> int:
    from towerflow.cli.progress import ProgressHook
    from towerflow.launch import train
    from towerflow.spec import load_spec

    spec = load_spec(args.spec, args.overrides)
    run = _RunIdHook()
    hooks = [run] if args.no_progress else [run, ProgressHook(spec.training.max_steps)]
    try:
        result = train(spec, hooks=hooks, resume=args.resume)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run ended KILLED; say how to go on with it
        if run.run_id:
            print(
                f"towerflow: run {run.run_id} stopped (KILLED in MLflow); to go on from its latest "
                f"checkpoint: {_resume_command(args, run.run_id)}",
                file=sys.stderr,
            )
        raise
    print(f"towerflow: {result.summary_line()}")
    if result.run_id:
        from towerflow.tracking import default_tracking_uri

        uri = default_tracking_uri(spec.tracking.tracking_uri)
        print(
            f"towerflow: browse it with: {_runnable('mlflow')} ui --backend-store-uri {uri}  "
            "(then open http://127.0.0.1:5000)"
        )
    return 0


def _resume_command(args: argparse.Namespace, run_id: str) -> str:
    """This train command again, resuming `run_id`, started as this one was: a Ray job runs
    `python -m towerflow`, a shell the console script."""
    module = Path(sys.argv[0]).name == "__main__.py"
    program = ["python", "-m", "towerflow"] if module else [_runnable("towerflow")]
    overrides = ["--set", *args.overrides] if args.overrides else []
    return shlex.join([*program, "train", str(args.spec), *overrides, "--resume", run_id])


class _RunIdHook(Hook):
    """Keeps the MLflow run id that the tracker (the first hook) put in the session's tags."""

    run_id: str | None = None

    def begin(self, session: SessionInfo) -> None:
        self.run_id = session.tags.get("run_id")
        if self.run_id:  # for `towerflow scale`, and for `towerflow submit` to find in the job's log
            print(f"towerflow: MLflow run {self.run_id}", flush=True)


def _runnable(command: str) -> str:
    """`command` as this shell can run it: by name where it is on PATH, else by its path in this
    Python's environment (relative where it lies below the working directory, as .venv/bin/mlflow)."""
    if shutil.which(command):
        return command
    beside = Path(sys.executable).parent / command
    with contextlib.suppress(ValueError):
        return os.fspath(beside.relative_to(Path.cwd()))
    return os.fspath(beside)


_SYNTH_OPTIONS = {
    "vocab_size": "ptb",
    "num_classes": "tabular",
    "num_categories": "tabular",
    "imbalance": "tabular",
}


def _synth(args: argparse.Namespace) -> int:
    from towerflow.data.synth import GENERATORS
    from towerflow.errors import SpecError

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


def _compare(args: argparse.Namespace) -> int:
    from towerflow.cli.progress import ProgressHook
    from towerflow.compare import compare_modes, parse_modes
    from towerflow.spec import load_spec

    modes = parse_modes(args.modes)
    spec = load_spec(args.spec, args.overrides)
    hooks = [] if args.no_progress else [ProgressHook(spec.training.max_steps)]
    comparison = compare_modes(args.spec, modes, overrides=args.overrides, hooks=hooks)
    for mode, result in comparison.results.items():
        print(f"towerflow: {mode}: {result.summary_line()}")
    print(
        f"towerflow: compared in run {comparison.parent_run_id} ({', '.join(comparison.plots)}); "
        f"browse it with: {_runnable('towerflow')} ui --store {comparison.tracking_uri}"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from towerflow.tracking.export import export_run

    exported = export_run(args.run_id, args.store)
    where = exported.registry_uri or exported.model_uri
    print(f"towerflow: exported run {args.run_id} as {where}")
    return 0


def _gpus(args: argparse.Namespace) -> int:
    from towerflow.runtime.cluster import ResourceBudget, ensure_ray
    from towerflow.tracking.cluster_gpus import format_table, probe_cluster

    ensure_ray(ResourceBudget(worker_cpus=0, ps_cpus=0, data_cpus=0, gpus=0))
    print(format_table(probe_cluster()))
    return 0


def _submit(args: argparse.Namespace) -> int:
    from towerflow.submit import follow, submit

    job = submit(args.spec, address=args.address, overrides=args.overrides, tracking_uri=args.tracking_uri)
    print(f"towerflow: submitted job {job.job_id} to {job.address} (its dashboard)", flush=True)
    print(f"towerflow: follow it with: {job.follow_command()}", flush=True)
    print(f"towerflow: stop it with:   {job.stop_command()}", flush=True)
    if args.no_wait:
        print("towerflow: its log names the MLflow run once training starts", flush=True)
        return 0

    def run_id(found: str) -> None:
        print(f"towerflow: the job tracks MLflow run {found}", flush=True)

    final = follow(job, lambda line: print(line, flush=True), run_id)
    print(f"towerflow: job {job.job_id} {final}", flush=True)
    return 0 if final == "SUCCEEDED" else 1


def _scale(args: argparse.Namespace) -> int:
    from towerflow.runtime.cluster import connect_existing
    from towerflow.runtime.run_control import request_scale

    connect_existing()
    request_scale(args.run_id, args.workers)
    print(f"towerflow: run {args.run_id} asked for {args.workers} worker(s); it resizes at its next poll")
    return 0


def _ui(args: argparse.Namespace) -> int:
    from towerflow.tracking.store import default_tracking_uri
    from towerflow.tracking.ui import start_ui, stop_ui

    store = default_tracking_uri(args.store)
    process = start_ui(store, host=args.host, port=args.port)
    print(
        f"towerflow: MLflow UI for {store} at http://{args.host}:{args.port}  (Ctrl-C stops it)", flush=True
    )
    try:
        return process.wait()
    finally:
        stop_ui(process)


if __name__ == "__main__":
    run()
