"""The controller's checkpoint manager (mixed into the Driver): a consistent cut of every shard at one
version, taken without pausing training, either gathered whole (`capture_state`, for hooks that
want the state) or written as a checkpoint by the shards themselves (`save_checkpoint`): each shard
writes its own part from its own node, and the driver writes `meta.json` last, so it never holds
the model's state. When to checkpoint stays a hook's decision. Memory checkpoints, the controller's
own for a rollback (runtime/memory_checkpoints.py), are kept here too.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import ray

from towerflow.checkpoint.stores import StoreUnavailable
from towerflow.errors import TrainingError
from towerflow.runtime.actors import ACTOR_GONE
from towerflow.runtime.hooks import FaultEvent, SavedCheckpoint
from towerflow.runtime.recovery import State

log = logging.getLogger(__name__)


class CheckpointActions:
    """Checkpointing verbs of the Driver, which provides the shards, the worker group, the update
    protocol, the state and the poll (`_turn`) these use."""

    def capture_state(self, version: int | None = None, data_position: dict[str, Any] | None = None):
        """All shards' state at one version: a consistent cut, taken without a pause."""
        from towerflow.checkpoint import assemble_state

        target = version if version is not None else self._next_version()
        snapshots = self._cut([s.snapshot.remote(target) for s in self.shards])
        if snapshots and self._ended_apart({s.version for s in snapshots}):
            return self.capture_state(None, data_position)
        if snapshots is None or (version is not None and any(s.version != version for s in snapshots)):
            # A shard was lost meanwhile (cut the rolled-back shards instead), or no longer held
            # `version` (it keeps the last few, and the chief heard of that step too late) or ended
            # before it: it answered with its state now. Cut again, at the next common version.
            return self.capture_state()
        state = assemble_state(
            snapshots,
            self.session.variables,
            self.session.pieces,
            self.session.shard_assignment,
            self.spec.training.optimizer.name,
            data_position or self._data_position(),
        )
        state.model_state = self.model_state()
        return state

    def save_checkpoint(
        self,
        store: Any,
        version: int | None = None,
        data_position: dict[str, Any] | None = None,
        skip: Collection[int] = (),
    ) -> SavedCheckpoint:
        """Each shard writes its own part of the checkpoint at one version, from its own node, and
        this writes `meta.json` last: the driver never holds the model's state."""
        from towerflow.checkpoint.files import checkpoint_meta, shard_part_name

        target = version if version is not None else self._next_version()
        if target in skip:
            return SavedCheckpoint(target, written=False)
        writer = store.writer(target)
        try:
            reports = self._cut(
                [
                    s.write_checkpoint.remote(target, writer, shard_part_name(i), term=self.term)
                    for i, s in enumerate(self.shards)
                ]
            )
            if reports is None or any(r.version != target for r in reports):
                writer.abort()
                versions = {r.version for r in reports or ()}
                if version is None and len(versions) == 1 and versions != {target}:
                    # every shard ended at the same earlier version (end of data, stop): save that one
                    return self.save_checkpoint(store, versions.pop(), data_position, skip)
                if self._ended_apart(versions):
                    return self.save_checkpoint(store, None, data_position, skip)
                later = self.save_checkpoint(store, None, None, skip)  # cut again, as capture_state does
                if version is not None and later.written:
                    log.info(
                        "checkpoint due at step %d taken at step %d: the shards had moved past it "
                        "(the driver heard of the step late)",
                        version,
                        later.step,
                    )
                return later
            if not all(r.finite for r in reports):
                writer.abort()
                return SavedCheckpoint(target, written=False, nonfinite=True)
            for shard, report in enumerate(reports):
                if report.relayed is not None:
                    self._relay_part(writer, shard_part_name(shard), report)
            model_state = self.model_state()
            if model_state:
                self._write_model_part(writer, model_state)
            session = self.session
            writer.commit(
                checkpoint_meta(
                    target,
                    self.spec.training.optimizer.name,
                    [(info.name, info.shape, info.dtype) for info in session.variables],
                    reports[0].slot_names,
                    self.shard_group.part_layouts(),
                    model_state,
                    data_position or self._data_position(),
                )
            )
        except StoreUnavailable:
            # An abort would not reach the store either. The parts written stay without a
            # meta.json: never listed, never picked by a resume, pruned by a later save.
            raise
        except BaseException:
            writer.abort()
            raise
        for shard in self.shards:  # each keeps its copy of this one, for a rollback
            shard.checkpoint_committed.remote(target)
        return SavedCheckpoint(target, written=True)

    def _keep_memory_checkpoint(self) -> None:
        """Begin a memory checkpoint when one is due, commit the one begun once every shard holds its
        part (runtime/memory_checkpoints.py); neither waits. A shard that does not answer is left to
        the loop's own look at the shards."""
        memory, shards = self.memory_checkpoints, self.shards
        self._watch_draining()
        if memory.due() and (holders := self.shard_group.memory_holders(self._worker_actors())):
            try:
                version = self._next_version(timeout_s=10)
            except (ray.exceptions.GetTimeoutError, *ACTOR_GONE):
                return
            memory.begin(shards, version, self.aggregator.examples_seen, holders, self._ask_model_state())
        version = memory.ready()
        if version is not None:
            committed = memory.commit(lambda refs: self._averaged_model_state(refs, timeout_s=0))
            shard_ids = {shard._actor_id for shard in shards}
            other_holders = {h._actor_id: h for h in committed.holders if h._actor_id not in shard_ids}
            for actor in [*shards, *other_holders.values()]:  # older copies, their own and held, can go
                actor.checkpoint_committed.remote(version)

    def _watch_draining(self) -> None:
        """While a node holding a shard drains (runtime/draining.py), memory checkpoints every
        `memory_checkpoint_draining_s`; an elastic run's workers there are replaced ahead (the
        resize asks for spares in their places). Each such node is told of once, as a fault tag."""
        memory = self.memory_checkpoints
        # Only an elastic run's workers can move (the others' bundles stay on the draining node).
        workers = (
            {worker: self.group.slots[worker].actor for worker in self.group.running}
            if self.elastic.elastic
            else None
        )
        for notice in self.drain_watch.look(self.shards, workers):
            actions = []
            if notice.shards and memory.draining_every_s is not None:
                if self.shard_group.memory_holders(self._worker_actors()):
                    actions.append(f"memory checkpoints every {memory.draining_every_s:g} s until it goes")
                else:  # one shard, no spare, no worker to hold its copy
                    actions.append(
                        "no other actor holds a memory checkpoint's copy: its loss goes back to the stored checkpoint"
                    )
            if notice.workers:
                actions.append("its workers are replaced ahead, as spares start elsewhere")
            action = "; ".join(actions) or "nothing to do before it goes"
            self._tell_fault(FaultEvent(self.group.global_step, notice.describe(), action))
        memory.draining = self.drain_watch.shards_draining

    def _worker_actors(self) -> list[Any]:
        """The running workers' actors, by id (one may hold a lone shard's memory checkpoint)."""
        return [self.group.slots[worker].actor for worker in self.group.running]

    def _ended_apart(self, versions: set[int]) -> bool:
        """True where the workers are gone and the shards ended at different `versions`, now
        settled at the furthest (`_settle_ended_shards`): cut again. Raises where they cannot be."""
        if len(versions) < 2 or not self._no_worker_to_come():
            return False
        if not self._settle_ended_shards(ray.get(self.shard_group.finish())):  # settling needs them finished
            raise TrainingError(f"shards ended at different versions {sorted(versions)}: no consistent cut")
        return True

    def _settle_ended_shards(self, versions: list[int]) -> bool:
        """Whether finished shards are at one version now: async shards that drifted apart
        (`AsyncProtocol.versions_drift`) take the furthest as their last, the state each ended
        with being the run's last. Sync shards never drift; apart, they are left as they are."""
        if len(set(versions)) < 2:
            return True
        if not self.protocol.versions_drift:
            return False
        log.info(
            "the shards ended at steps %s (async: a late gradient some dropped and others applied, or "
            "a lost worker's push that reached only some): their last states are the run's step %d",
            versions,
            max(versions),
        )
        ray.get(self.shard_group.settle_at(max(versions)))
        return True

    def _next_version(self, timeout_s: float | None = None) -> int:
        return max(ray.get([s.ping.remote() for s in self.shards], timeout=timeout_s)) + 1

    def _cut(self, refs: list[Any]) -> list[Any] | None:
        """Every shard's answer for one version; None where a shard was lost meanwhile (the shards
        have been rolled back by then)."""
        rollbacks = self._rollbacks
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            if len(ready) == len(refs):
                break
            if self.state is State.RUNNING:
                # Keep hearing of the workers meanwhile: a sync step waits for a lost one until the
                # shards retire it, and the records drained here are reported after this hook.
                self._backlog.extend(self._turn())
            if self._no_worker_to_come():
                # The workers are gone (end of data, stop): nothing will reach the target; end the shards.
                ray.get(self.shard_group.finish())
        try:
            return ray.get(refs) if self._rollbacks == rollbacks else None
        except ACTOR_GONE:  # a shard died under the cut: the controller rolls the shards back first
            self._backlog.extend(self._turn(suspect_shards=True))
            return None

    @staticmethod
    def _relay_part(writer: Any, part: str, report: Any) -> None:
        """Write a part that its shard could not write (one part in memory at a time)."""
        log.warning("checkpoint part %s goes through the driver: %s", part, report.relay_reason)
        files = ray.get(report.relayed)
        with tempfile.TemporaryDirectory(prefix="towerflow-part-") as scratch:
            for name, payload in files.items():
                (Path(scratch) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(scratch) / name).write_bytes(payload)
            del files
            writer.write_part(part, scratch)

    @staticmethod
    def _write_model_part(writer: Any, model_state: dict[str, np.ndarray]) -> None:
        from towerflow.checkpoint.files import MODEL_PART, write_part

        with tempfile.TemporaryDirectory(prefix="towerflow-part-") as scratch:
            write_part(scratch, list(model_state.values()), [])
            writer.write_part(MODEL_PART, scratch)
