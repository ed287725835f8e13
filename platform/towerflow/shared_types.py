"""Types that several layers share, so that none imports another's internals: data/ builds worker
streams that the runtime's workers read, and checkpoint/ joins the variable pieces that the
runtime's shards hold. Plain data and small behaviour only; nothing here starts Ray or TensorFlow.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

NOT_INPUTS = ("example_id",)  # columns that are never model inputs (like the label)


# -- variables, cut into pieces over the shards ----------------------------------------------------
@dataclass(frozen=True)
class VariableInfo:
    """A trainable variable as the driver sees it: position in the model, name, shape, size."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of variable `variable` (the whole variable when not cut); `index` is its id."""

    index: int
    variable: int
    start: int
    stop: int
    shape: tuple[int, ...]
    nbytes: int
    name: str

    def covers(self, info: VariableInfo) -> bool:
        return self.start == 0 and self.stop == (info.shape[0] if info.shape else 1)

    def of(self, value):
        """This piece's rows of the whole variable's value (a view, not a copy)."""
        return value[self.start : self.stop] if self.shape else value


def join_pieces(per_shard: list[list], pieces: list[Piece], assignment: list[list[int]]) -> dict[int, object]:
    """Whole variables (by variable index) from each shard's piece values, in `assignment` order."""
    parts: dict[int, list[tuple[int, object]]] = {}
    for indices, values in zip(assignment, per_shard, strict=True):
        for index, value in zip(indices, values, strict=True):
            piece = pieces[index]
            parts.setdefault(piece.variable, []).append((piece.start, value))
    return {
        variable: np.concatenate([v for _, v in sorted(chunks, key=lambda c: c[0])])
        if len(chunks) > 1
        else np.array(chunks[0][1])
        for variable, chunks in parts.items()
    }


# -- the shape of an update, as the data plan needs it ---------------------------------------------
@dataclass(frozen=True)
class StepShape:
    """What planning the data needs of the update protocol (runtime/protocol.py decides it): whether
    every worker takes part in every update (each then gets an equal share of the data), and how
    many batches one update takes."""

    lockstep: bool
    batches_per_update: int


class DataFeed(NamedTuple):
    """What the driver's `make_data` gives it (data/ makes the streams): one stream per worker, the features' scales, the
    most global steps the streams make from where they start (None: unknown), and a node id -> the ref of readying a
    process there for the read tasks of the next streams (a spare's node, before it joins)."""

    splits: Sequence[Any]
    feature_scales: dict[str, float]
    steps: int | None = None
    ready_node_for_reading: Callable[[str], Any] | None = None
    # The data position the streams start at, which the run counts on from (None: the one asked
    # for); below it where a partly read file is read again from its start.
    position: int | None = None


# -- a worker's stream of training data ------------------------------------------------------------
@dataclass
class StreamOptions:
    prefetch_batches: int = 2
    varlen: dict[str, dict[str, Any]] = field(default_factory=dict)  # name: {"ragged": bool, "default": ..}
    tower_preprocess: list[str] = field(default_factory=list)  # import refs: fn(features, training)


@dataclass
class WorkerStream:
    """One worker's split of the training data and how to iterate it."""

    iterator: Any  # ray.data.DataIterator
    options: StreamOptions = field(default_factory=StreamOptions)
    rows_before: int = 0  # rows of this split used before this stream's first (by a lost predecessor)

    def batches(
        self,
        *,
        batch_size: int,
        drop_last: bool,
        shuffle_buffer: int,
        seed: int,
        stop: threading.Event | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches of `batch_size` examples; with drop_last the worker's last partial batch of the run
        is dropped; a seeded local shuffle buffer when shuffle_buffer > 0. With `stop`, the stream
        ends as soon as it is set, even while waiting for a batch (see `until_stopped`)."""
        batches = self.iterator.iter_batches(
            batch_size=batch_size,
            batch_format="numpy",
            drop_last=drop_last,
            prefetch_batches=self.options.prefetch_batches,
            local_shuffle_buffer_size=shuffle_buffer or None,
            local_shuffle_seed=seed if shuffle_buffer else None,
        )
        if stop is not None:
            batches = until_stopped(iter(batches), stop)
        return self._acknowledging(batches) if hasattr(self.iterator, "acknowledge") else iter(batches)

    def _acknowledging(self, batches: Any, every_s: float = 0.5) -> Iterator[dict[str, np.ndarray]]:
        """Tell the split which rows are used: a batch is, once the next one is asked for (its step
        is over). The split then lets go of those blocks and keeps only what a replacement needs."""
        used, told = self.rows_before, time.monotonic()
        for batch in batches:
            yield batch
            used += len(next(iter(batch.values()))) if batch else 0
            if time.monotonic() - told > every_s:
                self.iterator.acknowledge(used)
                told = time.monotonic()

    def taken_over(self, rows_before: int) -> WorkerStream:
        """The same split for a replacement worker, where the split can be taken over (see
        data/splits.py), `rows_before` rows of it used or handed over already; else the split as it
        is (a fixed iterator starts over)."""
        take = getattr(self.iterator, "taken_over", None)
        return WorkerStream(take(), self.options, rows_before) if take else self

    def leftover(self, used: int) -> list[Any]:
        """The rows this split gave out beyond the first `used` (a lost worker's unused batches)."""
        find = getattr(self.iterator, "leftover", None)
        return find(used) if find else []

    def close(self) -> Any:
        """End every split of this data set now, where the split can (the data is re-planned, the
        run ends). Returns what to wait on for reading to stop (a Ray ref), or None."""
        close = getattr(self.iterator, "close", None)
        return close() if close is not None else None

    def shut_down(self) -> None:
        """The run is over and the splits closed: end the process that serves them, where the
        split has one (data/splits.py)."""
        shut_down = getattr(self.iterator, "shut_down", None)
        if shut_down is not None:
            shut_down()


_END = object()


def until_stopped(items: Iterator[Any], stop: threading.Event, poll_s: float = 0.2) -> Iterator[Any]:
    """`items`, read ahead by one in a thread of their own, ending when `stop` is set, even while
    the next item is awaited: a block lost with its node may take Ray for ever to make again (its
    read task waiting for cores), and a worker asked to stop for a resize or a rollback must not
    wait for it. The reading thread is then left to end on its own. Errors pass through."""
    handed: queue.Queue = queue.Queue(maxsize=1)

    def offer(item: Any) -> bool:
        while not stop.is_set():
            try:
                handed.put(item, timeout=poll_s)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for item in items:
                if not offer(item):
                    return
            offer(_END)
        except BaseException as exc:  # raised to the consumer, in its thread
            offer(exc)

    threading.Thread(target=read, name="towerflow-batches", daemon=True).start()
    while not stop.is_set():
        try:
            item = handed.get(timeout=poll_s)
        except queue.Empty:
            continue
        if item is _END:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


def as_stream(data: Any) -> WorkerStream:
    return data if isinstance(data, WorkerStream) else WorkerStream(data)
