"""A worker's pushes to a shard taken in the order it sent them.

Ray runs an async actor's calls in no set order (a call whose arguments arrive first may start
first). With `training.overlap_push` a worker has two pushes of one bucket in flight, and a shard
that took the later first would count one more version of staleness for the earlier one (and
drop it past `max_staleness`). Such pushes carry their number in the worker's run; a shard takes
a worker's pushes of a bucket in that order, waiting for the one before up to `WAIT_S` (one lost
in transit, with its worker: the later goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

WAIT_S = 5.0

Key = tuple[int, int, int]  # (worker, its run's incarnation, bucket)
_UNORDERED = contextlib.nullcontext()


class PushOrder:
    """One shard's record of where each worker's numbered pushes stand, bucket by bucket."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self._wait_s = wait_s
        self._next: dict[Key, int] = {}  # the number of the push each worker's bucket takes next
        self._waiting: dict[Key, set[int]] = {}  # the numbers that arrived before their turn
        self._changed: asyncio.Condition | None = None  # made in the actor's event loop
        self.closed = False  # the shard's run it kept order for is over (loaded again)
        self._holding = True  # False once the shard takes no more gradients: nothing waits

    def turn(self, key: Key, number: int | None) -> contextlib.AbstractAsyncContextManager[None]:
        """Enter in the push's turn; on leaving, the next may go. `number` None: a push that is
        the only one of its worker in flight, taken as it comes (nothing to keep)."""
        return _UNORDERED if number is None else self._in_turn(key, number)

    @contextlib.asynccontextmanager
    async def _in_turn(self, key: Key, number: int) -> AsyncIterator[None]:
        await self.wait_turn(key, number)
        try:
            yield
        finally:
            await self.taken(key, number)

    async def wait_turn(self, key: Key, number: int) -> None:
        """Return once the pushes numbered below `number` have been taken; where some of them have
        not come within the wait, the first push waiting goes on without them."""
        if not self._holding or self._next.get(key, 0) >= number:
            return
        loop, changed = asyncio.get_running_loop(), self._condition()
        deadline = loop.time() + self._wait_s
        waiting = self._waiting.setdefault(key, set())
        waiting.add(number)
        try:
            async with changed:
                while self._holding and self._next.get(key, 0) < number:
                    left = deadline - loop.time()
                    if left <= 0 and number == min(waiting):
                        self._next[key] = number  # those before it are not coming
                        break
                    with contextlib.suppress(asyncio.TimeoutError):  # another's turn wakes it earlier
                        await asyncio.wait_for(changed.wait(), left if left > 0 else None)
        finally:
            waiting.discard(number)

    async def taken(self, key: Key, number: int) -> None:
        self._next[key] = max(self._next.get(key, 0), number + 1)
        await self._wake()

    def close(self) -> None:
        """The shard is loaded again (a rollback): pushes still waiting go on at once, to be turned
        away, not held their wait and then taken into the new run."""
        self.closed = True
        self.let_go()

    def let_go(self) -> None:
        """The shard takes no more gradients (finished, or at max_steps): pushes still waiting, and
        any after them, go on at once to hear so, rather than wait for a predecessor lost with its
        worker."""
        self._holding = False
        if self._changed is not None:
            asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def forget(self, worker: int) -> None:
        """A worker's new run (its earlier runs' numbers are done with)."""
        self._next = {key: n for key, n in self._next.items() if key[0] != worker}
        self._waiting = {key: w for key, w in self._waiting.items() if key[0] != worker or w}

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed
