"""benchmarks/faults_cluster.py's elastic cases: a node joins an elastic run and is lost; a node it
grew onto drains, a spare takes its worker's place, then it is lost (the case list there)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from faults_cluster_rows import SYNC, Log, clean_run, result, write_spec
from faults_driver import (
    CaseError,
    Driver,
    actors,
    latest_run,
    mlflow_client,
    now_ms,
    poll_store,
    run_outcome,
    seconds_after,
    start_driver,
    wait_for_record,
    wait_for_step,
)

ELASTIC = {**SYNC, "workers": {"min": 1, "max": 4}, "cpus_per_worker": 1.5}
ELASTIC_STEPS = 200  # room for a spare's start (10-40 s here) and two resizes before max_steps
ELASTIC_DRAINED = "elastic: node drained, then lost"


def clean_elastic(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    return {"clean elastic": clean_run(cluster, args, tmp, "clean-elastic", ELASTIC, args.elastic_steps)}


def resize_seconds(client, run_id: str, workers: float, since_ms: int, driver: Driver) -> tuple[float, float]:
    """(seconds from `since_ms` to MLflow's `workers` record of `workers`, seconds from that record to
    the first step after the resize): the resize, and the pause before training goes on (the data
    pipeline starts again). Steps drained by the resize are reported after it: they do not count."""
    resized = wait_for_record(client, run_id, "workers", since_ms, driver, lambda m: m.value == workers)
    step = wait_for_record(
        client, run_id, "global_step", resized.timestamp, driver, lambda m: m.value > resized.step
    )
    return seconds_after(resized, since_ms), seconds_after(step, resized.timestamp)


def elastic(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    client = mlflow_client(tmp)
    spec = write_spec(tmp, "elastic", args, ELASTIC, args.elastic_steps)
    driver = start_driver(cluster, spec, tmp / "driver.log")
    seen: dict[str, tuple[float, float]] = {}  # grow, shrink: (resize s, pause s)
    node, notes = None, []
    try:
        run_id, _ = wait_for_step(client, "elastic", args.at, driver)
        started = client.get_run(run_id).data.metrics["workers"]
        asked = time.monotonic()
        node = cluster.add_node(num_cpus=2)  # room for the pending spare
        notes.append(
            f"{started:g} workers at first; {node.name} alive {time.monotonic() - asked:.1f} s after"
        )
        seen["grow"] = resize_seconds(client, run_id, started + 1, now_ms(), driver)
        log(f"  grew {seen['grow'][0]:.1f} s after {node.name} joined")
        if node.node_id not in {a["node_id"] for a in actors(cluster, "TowerWorker")}:
            notes.append(f"the run grew, but {node.name} holds no worker")
        killed = now_ms()
        cluster.kill_node(node)  # while the grown run trains
        seen["shrink"] = resize_seconds(client, run_id, started, killed, driver)
        log(f"  shrank {seen['shrink'][0]:.1f} s after {node.name} was lost")
        driver.wait()
    except CaseError as exc:
        notes.append(f"{exc}")
    finally:
        driver.kill()
        if node is not None and not node.killed:
            cluster.kill_node(node)  # the next case gets the room this one started with
    notes += [
        f"{k}: `workers` changed {r:.1f} s after, the next step {p:.1f} s later" for k, (r, p) in seen.items()
    ]
    # The driver's own account of each resize: how long the workers took to stop, the data to plan.
    notes += [
        line.split("resized", 1)[1].strip() for line in driver.text().splitlines() if "resized from" in line
    ]
    run = poll_store(lambda: latest_run(client, "elastic"))
    ok, outcome = (
        run_outcome(client, run.info.run_id, driver, args.elastic_steps)[::2] if run else (False, [])
    )
    rate = driver.examples_per_sec()
    grow, shrink = seen.get("grow", (None,))[0], seen.get("shrink", (None,))[0]
    return {
        "elastic: node joins": result(
            driver.wall_s, grow is not None, examples_per_sec=rate, recovery_s=grow, notes=notes + outcome
        ),
        # not tried when the run never grew; survived: it shrank, trained on and finished at max_steps
        "elastic: node lost": result(
            driver.wall_s,
            None if grow is None else ok and shrink is not None,
            examples_per_sec=rate,
            recovery_s=shrink,
        ),
    }


def elastic_drained(cluster, args, tmp: Path, log: Log) -> dict[str, dict]:
    """As `elastic`, but the node the run grew onto is drained (`ray drain-node`, 300 s of
    deadline) and a second node joins: the spare asked for at the notice starts there and takes
    the drained node's worker's place in one resize (`workers` recorded again at the same count);
    then the drained node is lost. Survived: no worker lost, the run finished at max_steps.
    Recovery: the notice to that resize."""
    client = mlflow_client(tmp)
    driver = start_driver(
        cluster, write_spec(tmp, "elastic-drained", args, ELASTIC, args.elastic_steps), tmp / "driver.log"
    )
    added: list[Any] = []
    notes: list[str] = []
    swap = None
    try:
        run_id, _ = wait_for_step(client, "elastic-drained", args.at, driver)
        started = client.get_run(run_id).data.metrics["workers"]
        added.append(cluster.add_node(num_cpus=2))  # room for the pending spare
        resize_seconds(client, run_id, started + 1, now_ms(), driver)
        noticed = now_ms()
        cluster.drain_node(added[0], deadline_s=300)
        added.append(cluster.add_node(num_cpus=2))  # room for the spare asked for at the notice
        swap, pause = resize_seconds(client, run_id, started + 1, noticed, driver)
        log(f"  {added[0].name}'s worker replaced {swap:.1f} s after the notice")
        notes.append(
            f"{started:g} workers at first; replaced {swap:.1f} s after the notice, next step {pause:.1f} s later"
        )
        cluster.kill_node(added[0])
        driver.wait()
    except CaseError as exc:
        notes.append(f"{exc}")
    finally:
        driver.kill()
        for node in added:
            if not node.killed:
                cluster.kill_node(node)  # the next case gets the room this one started with
            cluster.wait_for_state(node, "DEAD")  # before the next run counts the room there is
    run = poll_store(lambda: latest_run(client, "elastic-drained"))
    ok, outcome = (
        run_outcome(client, run.info.run_id, driver, args.elastic_steps)[::2] if run else (False, [])
    )
    lost = run.data.metrics.get("workers_lost", 0.0) if run else None
    return {
        ELASTIC_DRAINED: result(
            driver.wall_s,
            ok and swap is not None and lost == 0,
            examples_per_sec=driver.examples_per_sec(),
            recovery_s=swap,
            notes=notes + outcome,
        )
    }
