"""NaN guard: a worker whose loss or gradients hold a NaN/inf pushes no gradient; this hook fails or stops the job,
or (skip) counts the dropped gradients and lets training go on.

Workers never push a non-finite gradient while the guard is on, so the shards (and so the last
checkpoint) hold the last good parameters. Under skip, a worker goes on with its next batch; a sync
step counts it with no gradient, so the others do not wait for it.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

from towerflow.errors import TrainingError
from towerflow.runtime.hooks import Hook, RunContext, StepEvent

log = logging.getLogger(__name__)


class NanGuardHook(Hook):
    def __init__(self, action: Literal["fail", "stop", "skip"] = "fail") -> None:
        self.action = action
        self.tripped_at: int | None = None
        self.skipped = 0  # gradients dropped under skip

    def after_run(self, context: RunContext, event: StepEvent) -> None:
        if math.isfinite(event.loss) and not event.nonfinite:
            return
        if self.action == "skip" and event.nonfinite:
            self.skipped += 1
            context.session.log_metrics({"nonfinite_skipped": float(self.skipped)}, event.global_step)
            return
        self.tripped_at = event.global_step
        where = f"worker {event.workers[0]}" if event.nonfinite and event.workers else "the step"
        what = (
            f"loss is {event.loss}"
            if not math.isfinite(event.loss)
            else f"the gradients hold NaN/inf (loss {event.loss:g})"
        )
        message = (
            f"{what} at global step {event.global_step} ({where}); nothing from that step "
            "was applied and the last good checkpoint is kept. Lower the learning rate, clip gradients "
            "(training.optimizer.clip_global_norm) or check the input data."
        )
        if self.action == "fail":
            raise TrainingError(message)
        log.warning("stopping: %s", message)
        context.request_stop("non-finite loss")
