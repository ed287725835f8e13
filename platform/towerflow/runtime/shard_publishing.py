"""What a parameter shard's replies carry (mixed into `ParameterShard`, which provides its
variables, version and `_done`).

A version that several workers read (sync: every worker of the step; a pull) is published once
into Ray's object store, when the first reply needs it, and they share the one copy. An async
push's reply carries the version itself: no other worker reads it (the next push makes a newer
one), so a shared copy would only add a put and Ray's borrowing of the reference. A version no
reply carries (async with fetch_every) is never sent at all.
"""

from __future__ import annotations

import time

import numpy as np
import ray

from towerflow.runtime.shard_replies import ParamsReply


class ShardPublishing:
    def _reset_publishing(self) -> None:
        self._params_ref = None
        self._published_version: int | None = None  # the version `_params_ref` holds
        self._publications = 0

    def _publish(self) -> None:
        # One object per version published; the previous one lives on only while some worker still
        # reads it.
        start = time.perf_counter()
        self._params_ref = ray.put(self._views())
        self._published_version = self._version
        self._publications += 1
        spent = time.perf_counter() - start
        self._last_apply_s += spent  # reported with the update it publishes
        self._apply_total_s += spent

    def _views(self) -> list[np.ndarray]:
        """The variables' values as views of their buffers: Ray copies them once, into the object
        store or into a reply; an update made before then leaves them as they are (TensorFlow
        copies a variable's buffer before updating it while a view of it lives)."""
        return [np.asarray(v.value()) for v in self._variables]

    def _next_params(self, lockstep: bool, with_params: bool) -> ParamsReply:
        """What a push's reply carries: no parameters where the worker goes on with its own
        (fetch_every), the one shared copy where every worker of the step reads this version
        (sync), else the version itself (async: only this reply reads it)."""
        if not with_params:
            return ParamsReply(self._version, None, self._done)
        if lockstep:
            return self._params_reply()
        self._publications += 1
        return ParamsReply(self._version, self._views(), self._done)

    def _params_reply(self) -> ParamsReply:
        """The current version, put in the object store by the first reply that needs it and
        shared by every reply after it (sync steps, pulls)."""
        if self._published_version != self._version:
            self._publish()
        return ParamsReply(self._version, self._params_ref, self._done)
