"""A shard's order of a worker's numbered pushes (overlap_push), in an event loop of its own."""

import asyncio
import time

from towerflow.runtime.push_order import PushOrder


def test_a_push_whose_predecessor_never_comes_goes_on_after_the_wait():
    """The earlier push lost in transit (its worker lost with it): the later one is not held for ever."""
    order = PushOrder(wait_s=0.2)

    async def pushes() -> list[str]:
        taken: list[str] = []

        async def push(number: int) -> None:
            async with order.turn((0, 7, 0), number):
                taken.append(f"push {number}")

        started = time.monotonic()
        await asyncio.gather(push(2), push(1))  # push 0 never comes
        taken.append("waited" if time.monotonic() - started >= 0.2 else "did not wait")
        await push(3)  # its turn at once
        order.forget(0)  # the worker's next run numbers from 0 again
        await asyncio.wait_for(push(0), 0.1)
        return taken

    assert asyncio.run(pushes()) == ["push 1", "push 2", "waited", "push 3", "push 0"]


def test_once_let_go_no_push_waits_for_its_turn():
    """The shard takes no more gradients: a push waiting for a lost predecessor, and any after it,
    go on at once (to hear that the run is done)."""
    order = PushOrder(wait_s=30.0)

    async def pushes() -> list[int]:
        taken: list[int] = []

        async def push(number: int) -> None:
            async with order.turn((0, 7, 0), number):
                taken.append(number)

        held = asyncio.create_task(push(2))  # push 0 and 1 never come
        await asyncio.sleep(0.05)
        assert taken == []
        order.let_go()
        await asyncio.wait_for(held, 1.0)
        await asyncio.wait_for(push(5), 1.0)
        return taken

    assert asyncio.run(pushes()) == [2, 5]
    assert not order.closed  # let go is not closed: the pushes are told the run is done, not turned away
