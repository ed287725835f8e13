"""What a parameter-server shard answers: the parameters to compute with, and a push's fate.

Apart from the shard (runtime/ps.py) so that workers read replies without importing the actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from towerflow.runtime.protocol import Verdict


@dataclass
class ParamsReply:
    version: int
    # list[np.ndarray] by ray.ObjectRef (one shared copy per version), or the list itself (a reply
    # of its own: `parameter_values` reads both), or None (the worker keeps the ones it has)
    params: Any
    done: bool


def parameter_values(replies: list[ParamsReply]) -> list[list[np.ndarray]]:
    """Each reply's parameters, those published by reference fetched in one `ray.get`."""
    shared = [reply.params for reply in replies if isinstance(reply.params, ray.ObjectRef)]
    fetched = iter(ray.get(shared))
    return [next(fetched) if isinstance(r.params, ray.ObjectRef) else r.params for r in replies]


@dataclass
class PushReply:
    verdict: Verdict  # APPLIED, STALE, REJECTED, SKIPPED or DONE
    step: int  # the global step this gradient went into; -1 when it was not applied
    staleness: int
    apply_s: float  # time of the apply this gradient went into
    next: ParamsReply  # the parameters to compute the next step with
    # The workers whose gradients the step applied (fewer than asked once workers retire); set in
    # the reply to a worker's last bucket, whose step is the one its record names.
    workers: tuple[int, ...] = ()
