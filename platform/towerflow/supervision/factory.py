"""Turn the spec's `supervision` section into hooks, in the order they must run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from towerflow.checkpoint.stores import CheckpointStore
from towerflow.errors import SpecError
from towerflow.imports import check_arguments, import_user_code
from towerflow.runtime.hooks import Hook, SessionInfo
from towerflow.supervision.artifacts import ArtifactSink
from towerflow.supervision.checkpoints import CheckpointSaverHook
from towerflow.supervision.evaluation import EvalHook
from towerflow.supervision.nan_guard import NanGuardHook
from towerflow.supervision.profiler import ProfilerHook
from towerflow.supervision.stop import StopAtStepHook


def build_supervision_hooks(
    spec: Any,
    *,
    checkpoint_store: Callable[[SessionInfo], CheckpointStore] | None,
    artifact_sink: Callable[[SessionInfo], ArtifactSink],
) -> list[Hook]:
    """Stop and NaN checks first (a bad step must not be checkpointed), then evaluation,
    checkpoints and profiles, then the user's hooks."""
    sup = spec.supervision
    hooks: list[Hook] = []
    if sup.stop_at_step is not None:
        hooks.append(StopAtStepHook(sup.stop_at_step.num_steps, sup.stop_at_step.last_step))
    if sup.nan_guard != "off":
        hooks.append(NanGuardHook(sup.nan_guard))
    if sup.eval is not None:
        hooks.append(
            EvalHook(
                sup.eval.every_steps,
                sup.eval.metrics,
                batch_size=sup.eval.batch_size or spec.data.batch_size,
                max_batches=sup.eval.max_batches,
                at_end=sup.eval.at_end,
            )
        )
    ckpt = sup.checkpoint
    if ckpt.enabled and checkpoint_store is not None:
        hooks.append(
            CheckpointSaverHook(
                checkpoint_store,
                every_steps=ckpt.every_steps,
                every_secs=ckpt.interval_secs,
                max_to_keep=ckpt.max_to_keep,
                keep_checkpoint_every_n_hours=ckpt.keep_checkpoint_every_n_hours,
                at_end=ckpt.at_end,
            )
        )
    if sup.profile is not None:
        hooks.append(
            ProfilerHook(sup.profile.start_step, sup.profile.stop_step, sup.profile.workers, artifact_sink)
        )
    hooks.extend(load_user_hooks(sup.hooks))
    return hooks


def load_user_hooks(refs: list[Any]) -> list[Hook]:
    """`supervision.hooks`: import strings (`pipelines.x:MyHook`) or {ref, params}; each names a Hook
    class or a factory returning one."""
    hooks = []
    for position, entry in enumerate(refs):
        ref, params = (entry, {}) if isinstance(entry, str) else (entry.ref, dict(entry.params))
        key = f"supervision.hooks[{position}]"
        target = import_user_code(ref, key=key)
        check_arguments(target, params, key=key, ref=ref)
        hook = target(**params)
        if not isinstance(hook, Hook):
            raise SpecError(f"{key}: {ref} gave a {type(hook).__name__}, not a towerflow Hook")
        hooks.append(hook)
    return hooks
