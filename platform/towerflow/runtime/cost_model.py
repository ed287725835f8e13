"""How long a training step takes for W workers, S shards and P parameters: the cost model.

A step of towerflow moves the model twice per worker (the parameters pulled, the gradients pushed)
and has each shard take in W pushes of its part, apply once (sync) or once per push (async), and
publish a new version. With B = 4P bytes, b examples per worker and the measured costs in `Costs`:

    worker   = compute(b) + 2 B (worker_s_per_byte) + 2 S call_s + 2 B / link   (link only across nodes)
               + n store_object_s                   (n objects on its path go through the object store)
               + overhead                           (the platform's own per step: Python, Ray, the driver)
    shard    = W ((B/S) push_s_per_byte + push_cpu_s) + k (B/S) (apply_s_per_byte + publish_s_per_byte)
                                                    (k = 1 sync, W async), or if longer: its node's
               link, W (B/S) / link each way, or its node's raylet, store_object_cpu_s an object
    sync     = worker + shard                       (the barrier: every push lands, then one apply)
    async    = max(worker + shard / W, shard)       (each worker loops on its own, waiting for its own
                                                     push's apply and version; a shard saturates)

per global batch (W b examples). Ray sends an array of up to `inline_bytes` inside the call that
carries it; a larger one goes through the object store, and each such object costs a fixed
latency and the raylet's CPU whatever its size (`store_objects` counts them: a push and its reply
when a shard's part is over the limit, and a sync version always, since it is `ray.put`).

On a machine with fewer cores than busy processes the CPU bounds it too: a worker needs cpu(b) +
its traffic + `worker_step_cpu_s` a step, and Ray's own processes, the driver and the data
pipeline `other_cpu_s` a global batch (they work per step: events, calls, batches; not at a steady
rate). Sync, the workers' part cannot be shorter than W worker-CPUs and the others' over the cores
(the shards' part follows it: the workers wait for the version then); async, the whole step cannot
be shorter than all processes' CPU over them. Workers sharing one machine compute side by side,
each slower than alone by the measured `compute_contention`.
The benchmark (benchmarks/costmodel.py) measures the constants, the per-process ones in a run of a
near-empty model, and checks the model against every measured run; `shards_for` is what
`cluster.ps: auto` asks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GBIT = 1e9 / 8  # bytes per second of one Gbit/s


@dataclass(frozen=True)
class Costs:
    """Per-step costs in seconds (per byte where named so); measured by benchmarks/costmodel.py."""

    compute_s_per_example: float  # a worker's forward and backward pass, one process alone
    compute_fixed_s: float  # its per-step floor (kernel launches, Python)
    compute_cores: float  # cores a worker's compute keeps busy (CPU seconds / wall seconds)
    worker_s_per_byte: float  # a worker: gradients out (serialize, object store) or parameters in
    push_s_per_byte: float  # a shard: take in one push (deserialize, sum into the step's total)
    apply_s_per_byte: float  # a shard: the optimizer's update (Adam)
    publish_s_per_byte: float  # a shard: put the new version into the object store
    call_s: float  # one actor call's round trip
    push_cpu_s: float = 0.0  # a shard's CPU per push beyond its bytes (Ray's call, the protocol, the reply)
    worker_step_cpu_s: float = 0.0  # a worker's CPU per step beyond compute and traffic
    # CPU of Ray's own processes, the driver and the data pipeline per global batch, beyond the raylet's
    # for objects in the store (store_object_cpu_s)
    other_cpu_s: float = 0.0
    # How many times slower a worker computes while another computes beside it on the same machine
    # (shared caches, memory bandwidth, sibling hardware threads): measured with two at once.
    compute_contention: float = 1.0
    # The platform's own time on a worker's path per step beyond the parts above (the driver's
    # bookkeeping, Ray Data's hand-over of a batch, Python around each phase): what a near-empty
    # model's step takes beyond what its parts predict.
    overhead_sync_s: float = 0.0
    overhead_async_s: float = 0.0
    # An object through Ray's object store (over the inline limit): the latency it adds to a call
    # beyond its bytes, and the raylet's CPU for it (its bookkeeping: locations, pins, hand-offs).
    store_object_s: float = 0.0
    store_object_cpu_s: float = 0.0
    # Ray's max_direct_call_object_size: larger arguments and replies go through the store
    inline_bytes: int = 100 * 1024
    link_bytes_per_s: float | None = None  # between nodes; None: all on one node

    def on_network(self, gbit_per_s: float) -> Costs:
        return replace(self, link_bytes_per_s=gbit_per_s * GBIT)


# The per-byte costs of LeNet's 13 MB, measured by benchmarks/costmodel.py on an AMD EPYC, 2 cores
# (2026-11-24 11:2x UTC, a slow hour); compute is LeNet's at one thread. `cluster.ps: auto` keeps
# the per-byte figures and estimates compute from the model's size (shard_count.py).
DEFAULT_COSTS = Costs(
    compute_s_per_example=1.9e-3,
    compute_fixed_s=3.0e-3,
    compute_cores=1.0,
    worker_s_per_byte=6.5e-10,
    push_s_per_byte=2.0e-10,
    apply_s_per_byte=3.6e-10,
    publish_s_per_byte=8.1e-10,
    call_s=8.5e-4,
    store_object_s=8.1e-4,  # (2026-11-28 15:2x UTC)
    store_object_cpu_s=8.3e-4,
)


@dataclass(frozen=True)
class Step:
    """A predicted step: seconds per global batch, and where they go."""

    seconds: float
    worker_s: float  # one worker's own part (compute and its traffic)
    shard_s: float  # one shard's part
    cpu_bound_s: float  # what the cores allow (0 when the machine has a core per process)
    path_s: float = 0.0  # the step's own path: worker then shard (sync), the slower loop (async)

    @property
    def bottleneck(self) -> str:
        """What sets the step: the cores when they allow less than the path, else the larger part."""
        if self.cpu_bound_s > self.path_s:
            return "cpu"
        return "workers" if self.worker_s >= self.shard_s else "shards"


def compute_s(costs: Costs, batch: int) -> float:
    return costs.compute_fixed_s + batch * costs.compute_s_per_example


@dataclass(frozen=True)
class StoreObjects:
    """Objects through Ray's object store in a step: on one worker's path, per shard, in all."""

    on_path: int  # a worker waits on each of these in turn
    per_shard: int  # a shard's node's raylet handles these each global batch
    per_global_batch: int


def store_objects(costs: Costs, *, workers: int, shards: int, params: int, mode: str) -> StoreObjects:
    """Which of a step's transfers go through the object store: a push (one per shard a worker
    sends to) and an async push's reply, each when a shard's part is over `inline_bytes`; a sync
    version whatever its size (`ray.put`, shared by the step's workers)."""
    stored = int(4 * params / shards > costs.inline_bytes)
    if mode == "sync":
        return StoreObjects(shards * (stored + 1), workers * stored + 1, shards * (workers * stored + 1))
    return StoreObjects(2 * shards * stored, 2 * workers * stored, 2 * workers * shards * stored)


def predict_step(
    costs: Costs,
    *,
    workers: int,
    shards: int,
    params: int,
    batch_per_worker: int,
    mode: str = "sync",
    cores: float | None = None,
) -> Step:
    """Seconds per global batch (`workers * batch_per_worker` examples). `cores`: the cores all
    processes share (one machine); None when every worker and shard has a machine of its own."""
    nbytes = 4 * params
    part = nbytes / shards  # bytes of one shard's part
    link = costs.link_bytes_per_s
    compute = compute_s(costs, batch_per_worker)
    if cores and workers > 1:  # workers that share a machine's cores compute side by side
        compute *= costs.compute_contention
    worker_traffic = 2 * nbytes * costs.worker_s_per_byte
    overhead = costs.overhead_sync_s if mode == "sync" else costs.overhead_async_s
    objects = store_objects(costs, workers=workers, shards=shards, params=params, mode=mode)
    worker = (
        compute
        + worker_traffic
        + overhead
        + 2 * shards * costs.call_s
        + objects.on_path * costs.store_object_s
        + (2 * nbytes / link if link else 0.0)
    )
    applies = 1 if mode == "sync" else workers
    shard_work = workers * (part * costs.push_s_per_byte + costs.push_cpu_s) + applies * part * (
        costs.apply_s_per_byte + costs.publish_s_per_byte
    )
    # A shard's node's link carries W parts each way; its raylet handles each of its objects.
    shard = max(
        shard_work, objects.per_shard * costs.store_object_cpu_s, workers * part / link if link else 0.0
    )
    # Async, a worker's loop waits for its own push's apply and version; W such loops share a shard.
    seconds = worker + shard if mode == "sync" else max(worker + shard / workers, shard)
    cpu_bound = 0.0
    if cores:
        workers_cpu = workers * (compute * costs.compute_cores + worker_traffic + costs.worker_step_cpu_s)
        other_cpu = costs.other_cpu_s + objects.per_global_batch * costs.store_object_cpu_s
        cpu_bound = (workers_cpu + shards * shard_work + other_cpu) / cores
        if mode == "sync":  # the workers' part, then the shards' (the workers wait for the version)
            cpu_bound = max(cpu_bound, (workers_cpu + other_cpu) / cores + shard)
    return Step(max(seconds, cpu_bound), worker, shard, cpu_bound, seconds)


def examples_per_s(costs: Costs, **kwargs) -> float:
    step = predict_step(costs, **kwargs)
    return kwargs["workers"] * kwargs["batch_per_worker"] / step.seconds


def shards_for(
    costs: Costs,
    *,
    workers: int,
    params: int,
    batch_per_worker: int,
    mode: str = "sync",
    most: int = 64,
    share: float = 0.1,
) -> int:
    """The fewest shards whose step is within `share` of the best any count up to `most` gives:
    more would buy little. (Not "as many as it takes to make the shards' part small": each shard
    takes W pushes a step whatever S is, and a shard's CPU per push does not shrink with its part,
    so past some count more shards only add calls.)"""
    shape = {"workers": workers, "params": params, "batch_per_worker": batch_per_worker, "mode": mode}
    steps = [predict_step(costs, shards=shards, **shape).seconds for shards in range(1, most + 1)]
    best = min(steps)
    return next(shards for shards, seconds in enumerate(steps, start=1) if seconds <= best * (1 + share))
