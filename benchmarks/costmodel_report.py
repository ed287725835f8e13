"""The cost model (towerflow/runtime/cost_model.py) from costmodel.py's measurements: checked against
every towerflow run of the peers benchmark, projected to 8-256 workers on a 25 Gbit/s network, as
Markdown tables and PNG plots for docs/benchmarks.md."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import numpy as np


def costs_from(found: dict, workload: str):
    """Costs (towerflow/runtime/cost_model.py) from one workload's measurements, with the platform's
    own: the tiny model's measured step less what the parts predict for it (on the path), and the
    CPU its processes used (in the CPU bound)."""
    from dataclasses import replace

    from towerflow.runtime.cost_model import Costs, predict_step, store_objects

    m = found[workload]
    batches = sorted(int(b) for b in m["compute"])
    walls = [m["compute"][str(b)]["wall_s"] for b in batches]
    slope, fixed = np.polyfit(batches, walls, 1)
    cores = statistics.median(m["compute"][str(b)]["cpu_s"] / m["compute"][str(b)]["wall_s"] for b in batches)
    nbytes = m["bytes"]
    costs = Costs(
        compute_s_per_example=float(max(slope, 0.0)),
        compute_fixed_s=float(max(fixed, 0.0)),
        compute_cores=float(cores),
        compute_contention=contention(m),
        worker_s_per_byte=(m["gradients_out_s"] + m["parameters_in_s"]) / 2 / nbytes,
        push_s_per_byte=m["push_s"] / nbytes,
        apply_s_per_byte=m["apply_s"] / nbytes,
        publish_s_per_byte=m["publish_s"] / nbytes,
        call_s=m["call_s"],
    )
    if "store_object" in found:  # (measured since 2026-11-28)
        costs = replace(
            costs,
            store_object_s=found["store_object"]["object_s"],
            store_object_cpu_s=found["store_object"]["object_cpu_s"],
        )
    if "overhead" not in found:
        return costs
    # The platform's own CPU, from the near-empty model's runs (both modes: their mean): a worker's
    # per step, a shard's per push (each global batch is W pushes), the rest's per global batch
    # less the raylet's for that model's objects in the store (the model counts those apart).
    runs = found["overhead"]
    if all("cpu_per_batch" in r for r in runs.values()):  # (measured since 2026-11-25)

        def other_cpu(mode: str, run: dict) -> float:
            shape = {"workers": run["workers"], "shards": 1, "params": run["params"], "mode": mode}
            stored = store_objects(costs, **shape).per_global_batch
            return run["cpu_per_batch"]["other"] - stored * costs.store_object_cpu_s

        costs = replace(
            costs,
            worker_step_cpu_s=statistics.mean(
                r["cpu_per_batch"]["workers"] / r["workers"] for r in runs.values()
            ),
            push_cpu_s=statistics.mean(r["cpu_per_batch"]["shards"] / r["workers"] for r in runs.values()),
            other_cpu_s=max(0.0, statistics.mean(other_cpu(mode, r) for mode, r in runs.items())),
        )
    overheads = {}
    for mode, tiny in found["overhead"].items():
        no_compute = replace(costs, compute_s_per_example=0.0, compute_fixed_s=0.0)
        parts = predict_step(
            no_compute,
            workers=tiny["workers"],
            shards=1,
            params=tiny["params"],
            batch_per_worker=32,
            mode=mode,
        )
        overheads[f"overhead_{mode}_s"] = max(0.0, tiny["seconds_per_batch"] - parts.seconds)
    return replace(costs, **overheads)


def contention(measured: dict) -> float:
    """How much slower a worker computes beside another than alone (1.0 where not measured)."""
    side = measured.get("compute_side_by_side")
    return max(1.0, side["wall_s"] / side["alone_wall_s"]) if side else 1.0


def check(found: dict, figures: dict) -> list[dict]:
    """Predicted against measured seconds per global batch for every towerflow configuration run."""
    from peers.workloads import WORKLOADS

    from towerflow.runtime.cost_model import predict_step

    rows = []
    for key, fig in sorted(figures.items()):
        config = fig.config
        # The model knows the two modes as shipped; async with fetch_every is measured, not modelled.
        if config.system not in ("towerflow_sync", "towerflow_async") or fig.rate is None:
            continue
        workload = WORKLOADS[config.workload]
        mode = config.system.removeprefix("towerflow_")
        step = predict_step(
            costs_from(found, config.workload),
            workers=config.workers,
            shards=1,
            params=found[config.workload]["params"],
            batch_per_worker=workload.global_batch // config.workers,
            mode=mode,
            cores=os.cpu_count(),
        )
        measured = workload.global_batch / fig.rate
        rows.append(
            {
                "key": key,
                "label": config.label,
                "measured_s": measured,
                "predicted_s": step.seconds,
                "error": step.seconds / measured - 1,
                "bottleneck": step.bottleneck,
            }
        )
    return rows


WORKERS = (8, 16, 32, 64, 128, 256)


def project(found: dict, gbit: float = 25.0) -> list[dict]:
    """Examples/sec from 8 to 256 workers, each on a machine of its own, shards too, on `gbit`."""
    from peers.workloads import WORKLOADS

    from towerflow.runtime.cost_model import examples_per_s, predict_step, shards_for

    rows = []
    for workload in ("lenet", "mlp"):
        costs = costs_from(found, workload).on_network(gbit)
        params, batch = found[workload]["params"], WORKLOADS[workload].global_batch // 2
        for mode in ("sync", "async"):
            for workers in WORKERS:
                shape = {"workers": workers, "params": params, "batch_per_worker": batch, "mode": mode}
                needed = shards_for(costs, **shape)
                one = predict_step(costs, shards=1, **shape)
                rows.append(
                    {
                        "workload": workload,
                        "mode": mode,
                        "workers": workers,
                        "rate_1_shard": examples_per_s(costs, shards=1, **shape),
                        "bottleneck_1_shard": one.bottleneck,
                        "shards_needed": needed,
                        "rate_needed": examples_per_s(costs, shards=needed, **shape),
                        "rate_ideal": workers * batch / one.worker_s,  # shards that cost nothing
                    }
                )
    return rows


def check_table(rows: list[dict]) -> str:
    lines = [
        "| configuration | measured, ms per global batch | predicted | error | bound by |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} ({r['key'].split('/')[0]}) | {1000 * r['measured_s']:.1f} | "
            f"{1000 * r['predicted_s']:.1f} | {r['error']:+.0%} | {r['bottleneck']} |"
        )
    return "\n".join(lines)


def constants_table(found: dict) -> str:
    lines = [
        "| measured on this machine | lenet | mlp |",
        "|---|---:|---:|",
    ]
    costs = {w: costs_from(found, w) for w in ("lenet", "mlp")}

    def own(name: str) -> str:  # the same for both workloads: measured on the near-empty model
        return f"{1000 * getattr(costs['lenet'], name):.2f}"

    rows = [
        ("parameters", lambda w: f"{found[w]['params']:,}"),
        (
            "compute, ms per example (one process, 1 thread)",
            lambda w: f"{1000 * costs[w].compute_s_per_example:.3f}",
        ),
        ("compute, fixed ms per step", lambda w: f"{1000 * costs[w].compute_fixed_s:.2f}"),
        (
            "compute beside a second computing process, x its time alone",
            lambda w: f"{costs[w].compute_contention:.2f}",
        ),
        (
            "worker: gradients out / parameters in, ms",
            lambda w: f"{1000 * found[w]['gradients_out_s']:.2f} / {1000 * found[w]['parameters_in_s']:.2f}",
        ),
        ("shard: take in one push, ms", lambda w: f"{1000 * found[w]['push_s']:.2f}"),
        ("shard: Adam over all parameters, ms", lambda w: f"{1000 * found[w]['apply_s']:.2f}"),
        ("shard: publish a version, ms", lambda w: f"{1000 * found[w]['publish_s']:.2f}"),
        ("actor call round trip, ms", lambda w: f"{1000 * found[w]['call_s']:.2f}"),
    ]
    if "store_object" in found:
        stored = found["store_object"]
        rows.append(
            (
                f"an object through the object store (over Ray's {stored['inline_bytes'] // 1024} KiB inline "
                "limit): latency / the raylet's CPU, ms",
                lambda w: own("store_object_s") + " / " + own("store_object_cpu_s"),
            )
        )
    if "overhead" in found:
        rows += [
            (
                f"towerflow's own time per global batch, {mode} (a 7,850-parameter model's step less its parts), ms",
                lambda w, mode=mode: f"{1000 * getattr(costs[w], f'overhead_{mode}_s'):.1f}",
            )
            for mode in ("sync", "async")
        ]
        if "cpu_per_batch" in found["overhead"]["sync"]:  # the CPU its processes used
            rows += [
                (
                    "towerflow's own CPU per worker step (the same model's), ms",
                    lambda w: own("worker_step_cpu_s"),
                ),
                ("a shard's own CPU per push (the same model's), ms", lambda w: own("push_cpu_s")),
                (
                    "CPU of Ray's own processes, the driver and the data pipeline per global batch, "
                    "beyond the raylet's for stored objects (the same model's), ms",
                    lambda w: own("other_cpu_s"),
                ),
            ]
        if "per_round" in found["overhead"]["sync"]:  # timed after each round of the runs
            rounds = zip(*(found["overhead"][mode]["per_round"] for mode in ("sync", "async")))
            timed = ", ".join(f"{1000 * s:.1f} / {1000 * a:.1f}" for s, a in rounds)
            rows.append(
                (
                    "the 7,850-parameter model's whole step after each round, sync / async, ms",
                    lambda w: timed if w == "lenet" else "",
                )
            )
    lines += [f"| {name} | {cell('lenet')} | {cell('mlp')} |" for name, cell in rows]
    across = found["across_nodes"]
    lines.append(
        f"| {across['bytes'] / 1e6:.1f} MB fetched from another node's object store / the same node's, ms | "
        f"{1000 * across['across_s']:.1f} / {1000 * across['within_s']:.1f} | |"
    )
    return "\n".join(lines)


def projection_table(rows: list[dict]) -> str:
    lines = [
        "| workload | mode | workers | ex/s, 1 shard | bound by | shards needed | ex/s with them | no shard cost |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['workers']} | {r['rate_1_shard']:,.0f} | {r['bottleneck_1_shard']} | "
            f"{r['shards_needed']} | {r['rate_needed']:,.0f} | {r['rate_ideal']:,.0f} |"
        )
    return "\n".join(lines)


def plot_check(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    measured = [1000 * r["measured_s"] for r in rows]
    predicted = [1000 * r["predicted_s"] for r in rows]
    ax.scatter(measured, predicted)
    for r, x, y in zip(rows, measured, predicted):
        ax.annotate(r["key"].replace("towerflow_", ""), (x, y), fontsize=7)
    top = max(measured + predicted) * 1.1
    ax.plot([0, top], [0, top], "k--", linewidth=0.8)
    ax.fill_between([0, top], [0, 0.75 * top], [0, 1.25 * top], color="grey", alpha=0.15, label="within 25%")
    ax.set_xlabel("measured ms per global batch")
    ax.set_ylabel("predicted ms per global batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_projection(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, workload in zip(axes, ("lenet", "mlp")):
        for mode, style in (("sync", "-"), ("async", "--")):
            picked = [r for r in rows if r["workload"] == workload and r["mode"] == mode]
            workers = [r["workers"] for r in picked]
            ax.plot(workers, [r["rate_1_shard"] for r in picked], style, marker="o", label=f"{mode}, 1 shard")
            ax.plot(
                workers, [r["rate_needed"] for r in picked], style, marker="s", label=f"{mode}, shards needed"
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers (a machine each, 25 Gbit/s)")
        ax.set_ylabel("predicted examples/sec")
        ax.set_title(workload)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
