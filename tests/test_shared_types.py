"""`until_stopped` (towerflow/shared_types.py): a worker's batch stream that a stop request ends
even while the next batch is awaited."""

from __future__ import annotations

import threading
import time

import pytest

from towerflow.shared_types import until_stopped


def test_it_passes_every_item_in_order_and_ends_with_them():
    assert list(until_stopped(iter(range(50)), threading.Event())) == list(range(50))


def test_a_stop_ends_the_wait_for_an_item_that_never_comes():
    never = threading.Event()

    def stuck():  # as a batch whose block was lost with its node
        yield 1
        never.wait()
        yield 2

    stop = threading.Event()
    items = until_stopped(stuck(), stop)
    assert next(items) == 1
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    assert next(items, None) is None
    assert time.monotonic() - started < 5
    never.set()


def test_an_error_of_the_stream_reaches_the_reader():
    def failing():
        yield 1
        raise ValueError("record 7 of shard-3 does not parse")

    items = until_stopped(failing(), threading.Event())
    assert next(items) == 1
    with pytest.raises(ValueError, match="record 7"):
        next(items)
