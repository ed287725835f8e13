"""Resumable splits (data/splits.py) on a real Ray Data stream: a consumer killed mid-split loses
no row, because its replacement reads the leftover and then takes the split over. (With workers:
tests/runtime/test_faults.py::test_sync_worker_killed_is_replaced_and_the_epoch_loses_no_example.)"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from towerflow.runtime.batches import leftover_batches

pytestmark = pytest.mark.timeout(180)


def test_a_killed_consumers_split_is_finished_by_its_replacement_with_no_row_lost(ray_cluster):
    ray = ray_cluster
    from towerflow.data.splits import resumable_streaming_split

    @ray.remote(num_cpus=0)
    class Consumer:
        def take(self, split, batches):
            self.it = iter(split.iter_batches(batch_size=5, batch_format="numpy", prefetch_batches=1))
            return [int(i) for _ in range(batches) for i in next(self.it)["id"]]

        def take_all(self, split, leftover=()):
            ids = [int(i) for b in leftover_batches(list(leftover), 5) for i in b["id"]]
            return ids + [
                int(i) for b in split.iter_batches(batch_size=5, batch_format="numpy") for i in b["id"]
            ]

    ds = ray.data.range(400, override_num_blocks=40).map_batches(lambda b: b)
    first, second = resumable_streaming_split(ds, 2, equal=False)
    # Both splits start the epoch together (Ray Data's barrier), as the workers of a run do.
    other = Consumer.remote().take_all.remote(second)
    lost = Consumer.remote()
    used = ray.get(lost.take.remote(first, 3))  # 15 rows trained on; more were handed to it
    ray.kill(lost)
    first.acknowledge(10)
    leftover = first.leftover(len(used))
    assert leftover  # the rows handed to it beyond the 15 it used
    # A call the lost consumer sent before it was killed may reach the coordinator only now (calls
    # from different callers are not ordered): it gets nothing, or the block it took is lost.
    epoch = ray.get(first.coordinator.current_epoch.remote())
    assert ray.get(first.coordinator.get.remote(epoch, first.split, 0)) is None
    rest = ray.get(Consumer.remote().take_all.remote(first.taken_over(), leftover))
    everything = used + rest + ray.get(other)
    assert sorted(everything) == list(range(400))  # every row once: none lost, none twice


def test_the_coordinator_is_an_actor_class_of_its_own_to_ray():
    """Not Ray's SplitCoordinator under another name: Ray looks an actor's class up by this name."""
    from towerflow.data.splits import _ledgered_coordinator

    descriptor = _ledgered_coordinator.__ray_metadata__.actor_creation_function_descriptor
    assert (descriptor.module_name, descriptor.class_name) == (
        "towerflow.data.splits",
        "_LedgeredCoordinator",
    )


def test_leftover_batches_cut_pieces_into_batches_in_order(ray_cluster):
    ray = ray_cluster
    from towerflow.data.splits import Leftover

    blocks = [ray.put(pa.table({"id": np.arange(10 * k, 10 * k + 10)})) for k in range(3)]
    pieces = [Leftover(blocks[0], 7, 10), Leftover(blocks[1], 0, 10), Leftover(blocks[2], 0, 4)]
    batches = [list(b["id"]) for b in leftover_batches(pieces, 6)]
    assert batches == [[7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23]]


def test_close_ends_a_split_whose_consumer_waits_for_a_block_that_does_not_come(ray_cluster):
    """As when a block is lost with a node and its read task waits to be made again: the
    controller's close (before a resize or rollback re-plans the data) must not wait for it."""
    ray = ray_cluster
    import time

    from towerflow.data.splits import resumable_streaming_split

    @ray.remote(num_cpus=0)
    class Consumer:
        def take_all(self, split):
            return sum(len(b["id"]) for b in split.iter_batches(batch_size=5, batch_format="numpy"))

    def stuck_after_the_first_block(batch):
        if batch["id"][0] >= 10:
            time.sleep(3600)
        return batch

    ds = ray.data.range(40, override_num_blocks=4).map_batches(stuck_after_the_first_block, batch_size=None)
    splits = resumable_streaming_split(ds, 2, equal=False)
    taken = [Consumer.remote().take_all.remote(split) for split in splits]
    ready, _ = ray.wait(taken, num_returns=2, timeout=5)
    assert not ready  # both wait for blocks that do not come
    splits[0].close()
    rows = ray.get(taken, timeout=60)
    assert sum(rows) <= 10  # the first block at most; then the end of the stream


def test_a_split_that_reaches_the_epoch_barrier_after_a_close_does_not_wait(ray_cluster):
    """A resize right after a grow: a worker's stream may start only after the controller closed
    the data it was given (the new worker's node was lost before its split came to the barrier)."""
    ray = ray_cluster
    from towerflow.data.splits import resumable_streaming_split

    @ray.remote(num_cpus=0)
    def take_all(split):
        return sum(len(b["id"]) for b in split.iter_batches(batch_size=5, batch_format="numpy"))

    splits = resumable_streaming_split(ray.data.range(40, override_num_blocks=4), 3, equal=False)
    ray.get(splits[0].coordinator.close.remote())  # closed before any split arrives
    assert ray.get([take_all.remote(split) for split in splits[:2]], timeout=60) == [0, 0]


@pytest.mark.parametrize("equal", [True, False])
def test_a_prestarted_split_reads_before_it_is_asked_and_each_row_comes_once(ray_cluster, tmp_path, equal):
    """The driver prestarts the reading while its workers start; the workers' first epoch must
    then run on that execution, not start a second one."""
    ray = ray_cluster
    import time

    from towerflow.data.splits import resumable_streaming_split

    @ray.remote(num_cpus=0)
    class Consumer:
        def take_all(self, split):
            return [int(i) for b in split.iter_batches(batch_size=5, batch_format="numpy") for i in b["id"]]

    def mark_read(batch):
        (tmp_path / f"block-{int(batch['id'][0])}-{time.monotonic_ns()}").touch()
        return batch

    ds = ray.data.range(60, override_num_blocks=6).map_batches(mark_read, batch_size=None)
    splits = resumable_streaming_split(ds, 2, equal=equal, prestart=True)
    deadline = time.monotonic() + 60
    while not any(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(tmp_path.iterdir()), "nothing was read before the splits asked"
    rows = [i for ids in ray.get([Consumer.remote().take_all.remote(s) for s in splits]) for i in ids]
    assert sorted(rows) == list(range(60))
    blocks_read = sorted(int(p.name.split("-")[1]) for p in tmp_path.iterdir())
    assert blocks_read == list(range(0, 60, 10))  # each block read once: one execution


def test_a_prestart_that_comes_after_a_split_started_its_epoch_leaves_the_epoch_alone(ray_cluster):
    """The prestart is sent without waiting: a warm worker of a resize may start the epoch first."""
    ray = ray_cluster
    import time

    from towerflow.data.splits import resumable_streaming_split

    @ray.remote(num_cpus=0)
    class Consumer:
        def first(self, split):
            self.it = iter(split.iter_batches(batch_size=5, batch_format="numpy", prefetch_batches=1))
            return [int(i) for i in next(self.it)["id"]]

        def rest(self):
            return [int(i) for b in self.it for i in b["id"]]

    def slowly(batch):
        time.sleep(0.5)  # still reading when the prestart arrives
        return batch

    ds = ray.data.range(60, override_num_blocks=6).map_batches(slowly, batch_size=None)
    (split,) = resumable_streaming_split(ds, 1, equal=False)
    consumer = Consumer.remote()
    first = ray.get(consumer.first.remote(split), timeout=60)
    ray.get(split.coordinator.prestart.remote(), timeout=60)
    rest = ray.get(consumer.rest.remote(), timeout=60)
    assert sorted(first + rest) == list(range(60))


def test_a_prestart_while_a_split_waits_at_the_first_barrier_keeps_its_arrival(ray_cluster):
    ray = ray_cluster
    import time

    from towerflow.data.splits import resumable_streaming_split

    @ray.remote(num_cpus=0)
    def take_all(split):
        return [int(i) for b in split.iter_batches(batch_size=5, batch_format="numpy") for i in b["id"]]

    splits = resumable_streaming_split(ray.data.range(60, override_num_blocks=6), 2, equal=False)
    early = take_all.remote(splits[0])
    time.sleep(1.0)  # split 0 waits at the barrier for split 1
    ray.get(splits[0].coordinator.prestart.remote(), timeout=60)
    late = take_all.remote(splits[1])
    rows = [i for ids in ray.get([early, late], timeout=60) for i in ids]
    assert sorted(rows) == list(range(60))
