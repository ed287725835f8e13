"""`towerflow` command line. Each subcommand parses its arguments and calls the public API."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from towerflow import messages
from towerflow.cli.cluster_command import add_cluster_command
from towerflow.cli.data_command import add_data_command
from towerflow.cli.options import add_overrides_option, add_store_option
from towerflow.cli.train_command import add_train_commands
from towerflow.errors import TowerflowError
from towerflow.runtime import signals
from towerflow.runtime.cluster import keep_embedded_ray_local
from towerflow.tracking.ui import DEFAULT_HOST, DEFAULT_PORT


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
        messages.say(
            "towerflow: error: the working directory no longer exists (deleted under this process: on a "
            "Ray node, another node's runtime-env agent cleaning a shared --temp-dir does this). Give "
            "each Ray node on a machine its own --temp-dir, and start the command again.",
            stream=sys.stderr,
        )
        return 2
    keep_embedded_ray_local()  # before any subcommand imports Ray
    messages.show()  # towerflow's log lines on stderr: libraries log, the command shows them
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except TowerflowError as exc:
        _stop_forwarding_ray_logs()
        messages.say(f"towerflow: error: {exc}", stream=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return _stopped()
    except Exception as exc:  # a bug, not a user error: keep the traceback, say what to do
        _stop_forwarding_ray_logs()
        traceback.print_exc()
        messages.say(
            f"towerflow: internal error: {type(exc).__name__}: {exc}\n"
            "This is a bug in towerflow (or an unexpected environment); please report it with the traceback above.",
            stream=sys.stderr,
        )
        return 1


def _stopped() -> int:
    """The last word and exit code of a command stopped by a signal: as a shell reports a process
    ended by SIGTERM (`ray job stop`, Kubernetes) or by Ctrl-C."""
    if signals.stopped_by_sigterm():
        messages.say("towerflow: terminated (SIGTERM)", stream=sys.stderr)
        return signals.EXIT_CODE
    messages.say("towerflow: interrupted", stream=sys.stderr)
    return 130


def _stop_forwarding_ray_logs() -> None:
    """Disconnect from Ray before the last word. Connected to a cluster, Ray's log thread prints
    actors' lines on stderr, each in two writes: one landing between them would glue the error to an
    actor's line, and late ones would bury it. Disconnecting joins that thread."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


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
    add_train_commands(sub)
    add_data_command(sub)

    ui = sub.add_parser("ui", help="start the MLflow UI over the run store, on 127.0.0.1")
    ui.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    ui.add_argument("--host", default=DEFAULT_HOST, help=f"interface to bind (default {DEFAULT_HOST})")
    add_store_option(ui)
    ui.set_defaults(handler=_ui)

    export = sub.add_parser(
        "export", help="export a run's latest checkpoint as a SavedModel, log and register it in MLflow"
    )
    export.add_argument("run_id", metavar="RUN_ID", help="the MLflow run (its spec.yaml and checkpoints/)")
    add_store_option(export)
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
    add_overrides_option(submit)
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
    messages.say(f"towerflow: submitted job {job.job_id} to {job.address} (its dashboard)")
    messages.say(f"towerflow: follow it with: {job.follow_command()}")
    messages.say(f"towerflow: stop it with:   {job.stop_command()}")
    if args.no_wait:
        messages.say("towerflow: its log names the MLflow run once training starts")
        return 0

    def run_id(found: str) -> None:
        messages.say(f"towerflow: the job tracks MLflow run {found}")

    final = follow(job, lambda line: print(line, flush=True), run_id)
    messages.say(f"towerflow: job {job.job_id} {final}")
    return 0 if final == "SUCCEEDED" else 1


def _scale(args: argparse.Namespace) -> int:
    from towerflow.runtime.cluster import connect_existing
    from towerflow.runtime.run_control import request_scale

    connect_existing()
    request_scale(args.run_id, args.workers)
    print(f"towerflow: run {args.run_id} asked for {args.workers} worker(s); it resizes at its next poll")
    return 0


def _ui(args: argparse.Namespace) -> int:
    from towerflow.tracking.store import default_tracking_uri, shown_address
    from towerflow.tracking.ui import start_ui, stop_ui

    store = default_tracking_uri(args.store)
    # SIGTERM (kill, a supervisor's stop) ends this command as Ctrl-C does: the server with it.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    process = start_ui(store, host=args.host, port=args.port)
    print(
        f"towerflow: MLflow UI for {shown_address(store)} at http://{args.host}:{args.port}  (Ctrl-C stops it)",
        flush=True,
    )
    try:
        return process.wait()
    finally:
        stop_ui(process)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    run()
