"""Per-worker streams that survive their worker: Ray Data's streaming split, with a ledger.

`Dataset.streaming_split` hands each block to one split as its coordinator produces it, whether or
not that split's consumer is still alive; a lost worker's split would keep receiving blocks that
nobody reads, and the blocks it had already taken would be gone with it. Here the coordinator also
keeps, per split, the blocks it gave out that the split's worker has not trained on yet (each
worker's stream acknowledges the rows it has used, runtime/batches.py). When a worker is
lost, its replacement first reads that worker's leftover (the rest of each block it had received,
from the first example not yet used) and then takes over the split where it stands. So a lost
worker loses no example of an epoch, and trains none twice beyond the batches it had in flight.

This leans on Ray Data's split coordinator (`ray.data._internal`), pinned with Ray in pyproject;
tests/data/test_splits.py fails if its shape changes.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.data._internal.iterator.stream_split_iterator import SplitCoordinator, StreamSplitDataIterator

from towerflow.data import claims

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leftover:
    """Part of a block a lost worker had received: rows [start, stop) of `block`."""

    block: Any  # ray.ObjectRef of a Ray Data block
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


# Ray's class as written, not the one `ray.remote` made of it: a subclass of that one inherits its
# `__ray_actor_class__`, and Ray then names this actor's class by Ray's own (the function
# descriptor under which workers look actor classes up). So named, a taken-over run's coordinator
# once failed to start: this `__init__` ran on an object that was not one of these.
_RAYS_COORDINATOR = SplitCoordinator.__ray_metadata__.modified_class.__ray_actor_class__


class _LedgeredCoordinator(_RAYS_COORDINATOR):
    """Ray Data's split coordinator, also keeping each split's blocks until their rows are used."""

    def __init__(self, dataset: Any, n: int, locality_hints: Any, name: str) -> None:
        # Ray Data says, once per process, that its progress bars are off (data/ingest.py turns
        # them off): not a line for every job's log.
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
        self._closed = False
        self._name = name  # the actor's, under which its execution's claim on the cores is recorded
        self._claimed: Any = None  # the execution last recorded
        super().__init__(dataset, n, locality_hints)
        self._ledger = threading.Condition()
        # per split: [block ref, rows] in the order given out, from the first block not wholly used
        self._given: dict[int, collections.deque[list[Any]]] = {i: collections.deque() for i in range(n)}
        self._dropped_rows = dict.fromkeys(range(n), 0)  # rows of the blocks let go (wholly used)
        # per split: how many times it was handed over; a `get` that began before a hand-over was
        # its lost consumer's, and what it returns late goes to the next consumer instead
        self._handovers = dict.fromkeys(range(n), 0)
        self._late: dict[int, collections.deque[Any]] = {i: collections.deque() for i in range(n)}
        self._asking = {i: collections.Counter() for i in range(n)}  # per split: holder -> calls waiting

    def prestart(self) -> None:
        """Start reading now, before any split asks: the driver calls this while its workers are
        still starting (importing TensorFlow, building the model), so the first batch is read
        meanwhile instead of after. The first epoch then begins on this execution.

        Only the execution starts here; the epoch state stays as it is. Ray's own epoch start
        (`_try_start_new_epoch`) also moves the epoch and resets the barrier's count, which a split
        already waiting at the barrier reads without the lock: it would be let through alone. And
        the call is sent without waiting, so a split may have started the first epoch already (a
        warm worker of a resize asks at once): then there is nothing to do.
        """
        with self._lock:
            if self._closed or self._cur_epoch != -1 or self._current_executor is not None:
                return
            dataset = self._base_dataset
            try:
                self._current_executor = dataset._create_executor()
                self._output_iterator = dataset._build_bundle_iterator(self._current_executor)
                self._current_executor.set_external_consumer_bytes(0)
                self._record_claim()
            except Exception:  # the first barrier starts it the usual way, and reports the error
                logger.warning("could not start reading ahead of the workers", exc_info=True)
                if self._current_executor is not None:
                    self._current_executor.shutdown(force=True)
                self._current_executor = self._output_iterator = None

    @property
    def _prestarted(self) -> bool:
        """Reading has begun and the first epoch has not: only a prestart does that."""
        return self._cur_epoch == -1 and self._current_executor is not None

    def close(self) -> None:
        """End every split's stream now: a consumer at the epoch barrier, waiting for a split whose
        consumer is gone, or arriving there later, is let through to an epoch with no data, and one
        waiting for a block (a block lost with a node, being made again) gets the end of the
        stream. The executor's tasks stop, which also frees the cores a lost block's re-made read
        task may be waiting for. The controller then re-plans the data.

        A run's end closes it too: the executor's shutdown withdraws its claim on the cluster's
        cores (Ray Data's autoscaling coordinator, a detached actor, splits every node's cores
        evenly, rounded down, between the executions it knows, and forgets one only 180 s after
        it last heard from it): left to the driver's exit, a finished run's claim halves what the
        next job's reads may use, or leaves a 2-CPU node none."""
        with self._lock:
            self._closed = True
            executor = self._current_executor
        if executor is not None:
            executor.shutdown(force=True)
            claims.wait_for_withdrawal()
        claims.forget(self._name)

    def _record_claim(self) -> None:
        """Record the running execution's claim, so that a later job withdraws it if this actor
        dies with its driver before the execution's shutdown does (towerflow/data/claims.py)."""
        executor = self._current_executor
        if executor is not None and executor is not self._claimed:
            claims.record(self._name, claims.requester_of(executor))
            self._claimed = executor

    # Ray's barrier waits while this count is not 0. Once closed it reads 0 whatever the splits
    # arriving later subtract from it, so nobody waits (a count set to 0 would go below it).
    @property
    def _num_unarrived_splits_at_barrier(self) -> int:
        return 0 if self._closed else self._unarrived

    @_num_unarrived_splits_at_barrier.setter
    def _num_unarrived_splits_at_barrier(self, value: int) -> None:
        self._unarrived = value

    def _try_start_new_epoch(self, starting_epoch: int):
        if not self._closed:
            with self._lock:
                if self._prestarted and self._cur_epoch == starting_epoch:  # keep the running execution
                    self._reset_state()
                    self._cur_epoch += 1
                    return None
            try:
                return super()._try_start_new_epoch(starting_epoch)
            finally:
                self._record_claim()
        with self._lock:  # an empty epoch: counted as started, and every `get` answers None
            if self._cur_epoch == starting_epoch:
                self._cur_epoch += 1
            if self._output_iterator is None:
                self._output_iterator = iter(())
        return None

    def get(self, epoch_id: int, output_split_idx: int, client_prefetched_bytes: int = 0, holder: int = 0):
        """The split's next block, for its consumer `holder` (0 the first, k after its k-th hand-over;
        Ray's own iterator passes none). A lost consumer's call gets nothing, whether it arrives
        after the hand-over (sent before its consumer was killed, or in flight meanwhile: calls
        from different callers are not ordered) or waits through it: what it would have had goes
        to the split's current consumer."""
        if self._closed:
            return None
        split = output_split_idx
        with self._ledger:
            if holder != self._handovers[split]:
                return None
            if self._late[split]:
                return self._late[split].popleft()  # in the ledger already
            self._asking[split][holder] += 1
        try:
            bundle = super().get(epoch_id, split, client_prefetched_bytes)
        except BaseException:
            with self._ledger:
                self._done_asking(split, holder)
            raise
        with self._ledger:
            self._done_asking(split, holder)
            if bundle is None:
                return self._last_late(split, holder)
            for entry in bundle.blocks:
                self._given[split].append([entry.ref, entry.metadata.num_rows or 0])
            if self._handovers[split] != holder:  # its caller was lost while it waited
                self._late[split].append(bundle)
                return None
        return bundle

    def _done_asking(self, split: int, holder: int) -> None:
        self._asking[split][holder] -= 1
        self._ledger.notify_all()

    def _last_late(self, split: int, holder: int, wait_s: float = 5.0) -> Any:
        """The split's stream has ended for its consumer `holder`; a lost consumer's call still
        waiting may have taken the last block and not yet put it with the late ones: wait for it."""
        if holder != self._handovers[split]:
            return None
        self._ledger.wait_for(
            lambda: not any(n for h, n in self._asking[split].items() if h < holder), wait_s
        )
        return self._late[split].popleft() if self._late[split] else None

    def holder(self, split: int) -> int:
        """Which consumer of `split` is the current one: how many times it was handed over."""
        with self._ledger:
            return self._handovers[split]

    def current_epoch(self) -> int:
        return self._cur_epoch

    def acknowledge(self, used: dict[int, int]) -> None:
        """Split -> examples its workers have used in all: let go of the blocks wholly used."""
        with self._ledger:
            for split, rows in used.items():
                given = self._given[split]
                while given and self._dropped_rows[split] + given[0][1] <= rows:
                    self._dropped_rows[split] += given.popleft()[1]

    def hand_over(self, split: int, used: int) -> list[Leftover]:
        """`split`'s consumer is lost, having used its first `used` rows: the rows given to it
        beyond those, block by block, for its replacement (which then takes the split over)."""
        self.acknowledge({split: used})
        with self._ledger:
            self._handovers[split] += 1
            skip = used - self._dropped_rows[split]
            pieces = []
            for ref, rows in self._given[split]:
                if skip < rows:
                    pieces.append(Leftover(ref, max(skip, 0), rows))
                skip -= rows
            return pieces

    def given_rows(self, split: int) -> int:
        with self._ledger:
            return self._dropped_rows[split] + sum(rows for _, rows in self._given[split])


_ledgered_coordinator = ray.remote(num_cpus=0)(_LedgeredCoordinator)


class ResumableSplit(StreamSplitDataIterator):
    """One worker's split. `taken_over()` gives the same split to a replacement, which joins the
    running epoch where it stands instead of waiting at the epoch barrier for every split."""

    def __init__(self, coordinator: Any, split: int, world_size: int, *, holder: int = 0):
        super().__init__(coordinator, split, world_size)
        self.coordinator = coordinator
        self.split = split
        self._holder = holder  # which consumer of the split this is (`_LedgeredCoordinator.get`)

    def taken_over(self) -> ResumableSplit:
        """The split for its next consumer, once `leftover` has handed it over."""
        holder = ray.get(self.coordinator.holder.remote(self.split))
        if holder <= self._holder:
            raise RuntimeError(f"split {self.split} was not handed over: call leftover() first")
        return ResumableSplit(self.coordinator, self.split, self._world_size, holder=holder)

    def leftover(self, used: int) -> list[Leftover]:
        """This split's consumer is lost after using `used` rows: what it had and did not use."""
        return ray.get(self.coordinator.hand_over.remote(self.split, used))

    def acknowledge(self, used: int) -> None:
        self.coordinator.acknowledge.remote({self.split: used})

    def close(self) -> Any:
        """End every split of this data set (a resize or rollback re-plans the data; a run ends).
        Returns the call's ref: done once reading has stopped."""
        return self.coordinator.close.remote()

    def shut_down(self) -> None:
        """End the coordinator's process, once the run is over and its reading stopped (`close`).
        Left to its handles going out of scope, a failed run's coordinator would live as long as
        the run's error (its traceback holds them: a notebook or a caller keeping the error keeps
        a process)."""
        ray.kill(self.coordinator)

    def _to_ref_bundle_iterator(self):
        if not self._holder:
            return super()._to_ref_bundle_iterator()
        coordinator, split, holder = self.coordinator, self.split, self._holder

        def running_epoch():
            epoch = ray.get(coordinator.current_epoch.remote())
            self._active_epoch = epoch  # so the end of iteration is reported as for any split
            while True:
                bundle = ray.get(coordinator.get.remote(epoch, split, 0, holder))
                if not bundle:
                    return
                yield bundle

        self._iter_stats.iter_prefetched_bytes = 0
        return running_epoch(), self._iter_stats, None


def resumable_streaming_split(
    dataset: Any, n: int, *, equal: bool, prestart: bool = False
) -> list[ResumableSplit]:
    """What `dataset.streaming_split(n, equal=equal)` makes, on a coordinator that keeps a ledger;
    `prestart` starts reading at once instead of when every split has asked for its first block."""
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators.streaming_split_operator import StreamingSplit
    from ray.data.dataset import Dataset

    op = StreamingSplit(num_splits=n, equal=equal, input_dependencies=[dataset._logical_plan.dag])
    split_dataset = Dataset._from_parent(dataset, LogicalPlan(op, dataset.context))
    split_dataset._set_uuid(dataset._uuid)
    claims.withdraw_orphaned()  # a killed driver's execution would otherwise keep half the cores
    name = claims.new_coordinator_name()
    coordinator = _ledgered_coordinator.options(
        name=name,
        namespace=claims.ACTOR_NAMESPACE,
        max_concurrency=n + 2,  # one thread per split (as Ray's own), one for shutting down, one to close
        label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
    ).remote(split_dataset, n, None, name)
    if prestart:
        coordinator.prestart.remote()
    return [ResumableSplit(coordinator, i, n) for i in range(n)]
