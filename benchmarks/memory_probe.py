"""The memory part of throughput.py: what shard and worker processes and Ray's object store hold.

RSS and its parts come from /proc (anon: private pages; shmem: object-store pages a process has
touched). A shard's state is set against two baselines: a bare TensorFlow actor, and a shard of a
model with next to no variables, whose private memory is what any shard costs.
"""

from __future__ import annotations

import os
from pathlib import Path

from towerflow.runtime.hooks import Hook

MIB = 1 << 20
STATUS_FIELDS = {"rss": "VmRSS", "peak": "VmHWM", "anon": "RssAnon", "file": "RssFile", "shmem": "RssShmem"}


class MemorySampler(Hook):
    """Samples shard and worker processes and the object store at the given global steps."""

    def __init__(self, at: list[int]) -> None:
        self.at, self.samples = at, {}

    def after_run(self, context, event) -> None:
        for step in self.at:
            if event.global_step >= step and step not in self.samples:
                self.samples[step] = sample_memory()


def actor_pids() -> dict[str, list[int]]:
    """Live shard and worker PIDs from the GCS actor table (ray.util.state needs the dashboard)."""
    import ray

    pids: dict[str, list[int]] = {"ParameterShard": [], "TowerWorker": []}
    for actor in ray._private.state.actors().values():
        if actor["State"] == "ALIVE" and actor["ActorClassName"] in pids:
            pids[actor["ActorClassName"]].append(actor["Pid"])
    return pids


def object_store() -> tuple[int, int]:
    """(bytes used, objects) of the local Ray object store, from the raylet's store stats."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)  # ours, not another job's Ray
    stats = get_memory_info_reply(state).store_stats
    return int(stats.object_store_bytes_used), int(stats.num_local_objects)


def referenced_objects() -> tuple[int, int]:
    """(bytes, objects) that some process of the job still holds a reference to: what a leaked
    ObjectRef would grow. The store's own use also counts objects freed but not yet deleted."""
    import ray
    from ray._private.internal_api import node_stats

    node = next(n for n in ray.nodes() if n["Alive"])  # the benchmark's Ray has one node
    reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=True)
    sizes = {
        ref.object_id: ref.object_size
        for worker in reply.core_workers_stats
        for ref in worker.object_refs
        if ref.object_size > 0
    }
    return sum(sizes.values()), len(sizes)


def process_memory(pid: int) -> dict[str, int]:
    """RSS and its parts from /proc, in bytes: anon is private, file is mostly shared libraries, shmem is
    object-store pages this process has touched (shared with the store)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return {key: int(fields[name].split()[0]) * 1024 for key, name in STATUS_FIELDS.items()}


def sample_memory() -> dict:
    pids = actor_pids()
    return {
        "ps": {p: process_memory(p) for p in pids["ParameterShard"]},
        "workers": {p: process_memory(p) for p in pids["TowerWorker"]},
        "store": object_store(),
        "referenced": referenced_objects(),
    }


def baseline_memory() -> dict[str, int]:
    """RSS of a Ray actor with a shard's CPU share that imports TensorFlow and makes one variable."""
    import ray

    @ray.remote(num_cpus=0.5)
    class Baseline:
        def rss(self) -> int:
            from towerflow.runtime.tf_setup import TFProcessConfig, configure_tensorflow

            configure_tensorflow(TFProcessConfig(cpus=0.5))
            import tensorflow as tf

            tf.Variable(tf.zeros([4])).assign_add(tf.ones([4]))
            return process_memory(os.getpid())

    actor = Baseline.remote()
    try:
        return ray.get(actor.rss.remote())
    finally:
        ray.kill(actor)


def print_rss_course(mem: dict) -> None:
    """RSS at every sample, object-store pages in brackets: whether growth levels off or keeps on."""
    steps = mem["steps"]
    print("rss by step, MiB (of which object-store pages)")
    print(f"{'process':<9}" + "".join(f"{step:>15}" for step in steps))
    last = mem[mem["last"]]
    for kind in ("ps", "workers"):
        for n, pid in enumerate(sorted(last[kind], key=lambda pid: -last[kind][pid]["rss"])):
            cells = (mem[step][kind][pid] for step in steps)
            print(
                f"{kind[:2] + str(n):<9}"
                + "".join(f"{c['rss'] / MIB:>8.0f} ({c['shmem'] / MIB:>4.0f})" for c in cells)
            )


def print_memory(mem: dict, threshold_pct: float) -> str:
    first, last, base = mem[mem["first"]], mem[mem["last"]], mem["baseline"]
    print(
        f"\nmemory: towerflow sync 2 workers, {mem['last']} steps; MiB at steps {mem['first']} and {mem['last']} "
        "(anon = private pages; shmem = object-store pages the process touched)"
    )
    print(
        f"{'process':<9}{'rss@' + str(mem['first']):>10}{'rss@' + str(mem['last']):>10}{'growth%':>9}{'peak':>8}"
        f"{'anon@' + str(mem['first']):>13}{'anon@' + str(mem['last']):>13}{'growth%':>9}{'shmem':>8}"
    )
    growth = []
    for kind in ("ps", "workers"):
        for n, pid in enumerate(sorted(last[kind], key=lambda pid: -last[kind][pid]["rss"])):
            a, b = first[kind][pid], last[kind][pid]
            rss_pct, anon_pct = (100 * (b[k] - a[k]) / a[k] for k in ("rss", "anon"))
            growth.append(rss_pct)
            print(
                f"{kind[:2] + str(n):<9}{a['rss'] / MIB:>10.1f}{b['rss'] / MIB:>10.1f}{rss_pct:>9.1f}"
                f"{b['peak'] / MIB:>8.1f}{a['anon'] / MIB:>13.1f}{b['anon'] / MIB:>13.1f}{anon_pct:>9.1f}"
                f"{b['shmem'] / MIB:>8.1f}"
            )
    print_rss_course(mem)
    store = (last["store"][0] - first["store"][0]) / MIB
    referenced = (last["referenced"][0] - first["referenced"][0]) / MIB
    for name, key, what in (
        ("object store", "store", "in use"),
        ("of which referenced", "referenced", "held by a live ObjectRef"),
    ):
        print(
            f"{name}: {first[key][0] / MIB:.1f} MiB ({first[key][1]} objects) -> "
            f"{last[key][0] / MIB:.1f} MiB ({last[key][1]} objects), {what}"
        )
    tiny = mem["tiny"]
    print(
        f"bare TensorFlow actor (0.5 CPU, one variable): rss {base['rss'] / MIB:.1f} MiB, "
        f"anon {base['anon'] / MIB:.1f} MiB; shard of a 7,850-parameter model (its fixed cost): "
        f"rss {tiny['rss'] / MIB:.1f} MiB, anon {tiny['anon'] / MIB:.1f} MiB"
    )
    print(
        f"{'shard':<9}{'state':>10}{'rss-base':>10}{'ratio':>9}{'anon-base':>14}{'ratio':>9}"
        f"{'anon-tiny':>14}{'ratio':>9}   (shards matched to processes by size)"
    )
    ratios, anon, over_tiny = [], [], []
    for n, (state, proc) in enumerate(
        zip(mem["state"], sorted(last["ps"].values(), key=lambda p: -p["rss"]))
    ):
        above = {k: proc[k] - base[k] for k in ("rss", "anon")}
        ratios.append(above["rss"] / state)
        anon.append(above["anon"] / state)
        over_tiny.append((proc["anon"] - tiny["anon"]) / state)
        print(
            f"{'ps' + str(n):<9}{state / MIB:>10.2f}{above['rss'] / MIB:>10.1f}{ratios[-1]:>9.2f}"
            f"{above['anon'] / MIB:>14.1f}{anon[-1]:>9.2f}"
            f"{(proc['anon'] - tiny['anon']) / MIB:>14.1f}{over_tiny[-1]:>9.2f}"
        )
    verdict = "within" if max(growth) < threshold_pct else "ABOVE"
    print(f"largest RSS growth {max(growth):.1f}% ({verdict} the {threshold_pct:g}% noise threshold)")
    return (
        f"memory: ps_state_ratio_max={max(ratios):.2f} ps_anon_state_ratio_max={max(anon):.2f} "
        f"ps_anon_over_fixed_ratio_max={max(over_tiny):.2f} "
        f"rss_growth_max_pct={max(growth):.1f} object_store_growth_mb={store:.1f} "
        f"referenced_growth_mb={referenced:.1f}"
    )
