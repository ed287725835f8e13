"""How a job's failures reach the user: checks the driver makes before any actor starts, the
user's own error found inside Ray's wrappers (a failed actor keeps only its text), and what a
worker says when the model, its loss and the data do not fit together."""

from __future__ import annotations

import re
from typing import Any

import ray

from towerflow import errors
from towerflow.errors import SpecError, TowerflowError, TrainingError
from towerflow.imports import UnimportableModule, check_arguments, import_user_code, signature_from_source


def check_model(model: Any) -> None:
    """A misspelt model ref or parameter fails here, named, before any actor starts. The builder's
    parameters are read from its module's source where that settles them: the module (which
    imports Keras, seconds of CPU) is not run in the driver. Else it is imported; a module this
    process cannot import is left to the workers: Ray may ship it to them from elsewhere."""
    build = signature_from_source(model.ref)
    if build is None:
        try:
            build = import_user_code(model.ref)
        except UnimportableModule:
            return
    check_arguments(build, model.params, key="model.params", ref=model.ref)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray Data appends its retry advice to an error from a read task's function ("Failed to apply UDF
# transform after 1/1 attempts ... if you believe this to be transient"): a bad record is not.
_RAY_DATA_RETRY_ADVICE = re.compile(r"\nFailed to [^\n]* after \d+/\d+ attempts \(total backoff .*\Z", re.S)


def _actor_init_error(exc: ray.exceptions.RayActorError) -> TowerflowError:
    """An actor's constructor failed. Ray keeps only its text: a user error raised there (a model
    module the workers cannot import, say) is rebuilt as itself; anything else keeps Ray's traceback."""
    text = _ANSI.sub("", str(exc)).strip()
    _, raised_here, raised = text.rpartition("\ntowerflow.errors.")
    name, _, message = raised.partition(": ")
    error_class = getattr(errors, name, None) if raised_here else None
    if isinstance(error_class, type) and issubclass(error_class, TowerflowError):
        return error_class(message)
    # Ray's text: a header naming the actor (pid, ids, repr), then the constructor's traceback. Lead
    # with what was raised; keep the traceback, which points into the user's model code.
    header, _, trace = text.partition("\n")
    trace = trace[max(0, trace.find('  File "')) :]  # Ray leaves the carets of frames it dropped
    actor = re.search(r"ray::(\w+)\.__init__", header)
    raised_line = trace.rstrip().rsplit("\n", 1)[-1] if trace.strip() else header
    return TrainingError(
        f"{actor.group(1) if actor else 'a training actor'} failed to start: {raised_line}\n{trace}".rstrip()
    )


def as_user_error(exc: BaseException) -> BaseException:
    """Find a TowerflowError inside Ray's wrappers (worker -> data task); else say which actor failed."""
    seen = exc
    for _ in range(8):
        # Ray re-raises a remote error as a class deriving from both RayTaskError and the original;
        # its message is Ray's traceback, so keep looking for the original underneath.
        if isinstance(seen, TowerflowError) and not isinstance(seen, ray.exceptions.RayError):
            return _without_retry_advice(seen)
        cause = getattr(seen, "cause", None) or seen.__cause__
        if cause is None:
            break
        seen = cause
    if isinstance(exc, ray.exceptions.RayActorError):
        if exc.actor_init_failed:
            return _actor_init_error(exc)
        return TrainingError(f"a training actor died: {exc}")
    return exc


def _without_retry_advice(exc: TowerflowError) -> TowerflowError:
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (_RAY_DATA_RETRY_ADVICE.sub("", exc.args[0]), *exc.args[1:])
    return exc


def misfit_error(
    exc: Exception, model: Any, config: Any, input_names: list[str], inputs: Any, labels: Any
) -> SpecError:
    """A worker's first step failed to build or run (`config`: its WorkerConfig). With a model that
    built, that is almost always the model, its loss and the data not fitting together: say so,
    with the shapes of each."""
    lines = [line.strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line and not line.startswith(("[[", "[Op:"))]
    gist = lines[-1].removeprefix(f"{type(exc).__name__}: ") if lines else ""
    gist = gist if len(gist) <= 160 else gist[:160] + " ..."
    fed = inputs if isinstance(inputs, dict) else {input_names[0]: inputs}
    fed_shapes = ", ".join(f"{name} {t.dtype.name} {list(t.shape)}" for name, t in fed.items())
    return SpecError(
        f"model: the first training step failed ({type(exc).__name__}: {gist}). The model, its loss "
        f"and the data do not fit together: the data gives the model {fed_shapes}, and labels "
        f"(data.train.label {config.label!r}) {labels.dtype.name} {list(labels.shape)}; the model "
        f"(model.params) outputs {_output_shape(model)}; model.loss is {config.loss} "
        f"(from_logits {str(config.from_logits).lower()})."
    )


def _output_shape(model: Any) -> Any:
    """The model's output shape for a message; '?' where Keras cannot tell (a subclassed model)."""
    try:
        return model.output_shape
    except Exception:  # noqa: BLE001 - only a message depends on it
        return "?"
