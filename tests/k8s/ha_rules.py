"""The rules of a build whose Ray clusters outlive their head (k8s/overlays/cpu-ha): the GCS in a
Redis of the build, the drivers off the head, job submitters as patient as the pods."""

from __future__ import annotations

from tests.k8s.rules import entrypoint_demand, group_resources, starting_groups
from tests.k8s.schemas import Object, name_of

# How long KubeRay's worker pods wait for a lost GCS (RAY_gcs_rpc_server_reconnect_timeout_s, which
# KubeRay sets under GCS fault tolerance): a head back later has lost the cluster anyway.
GCS_RECONNECT_S = 600


def submitter_patience_s(backoff_limit: int) -> float:
    """How long after its first failure a Kubernetes Job's last retry starts at the latest: the Job
    controller waits 10 s, 20 s, 40 s ... (at most 6 minutes) before each retry."""
    return sum(min(10 * 2**attempt, 360) for attempt in range(backoff_limit))


def head_fault_tolerance_problems(objects: tuple[Object, ...] | list[Object]) -> list[str]:
    """A build whose Ray clusters outlive their head (the cpu-ha overlay): the GCS's tables in a Redis
    of the build, its password from a Secret; the head trains nothing; each RayJob's driver in a
    group of its own, which only it asks for, always there and with no CPUs to draw training there;
    and job submitters that retry for as long as the other pods wait for the head."""
    clusters = [o for o in objects if o["kind"] == "RayCluster"]
    if len(clusters) != 1:
        return [f"one RayCluster expected, not {len(clusters)}"]
    cluster = clusters[0]
    where, spec = name_of(cluster), cluster["spec"]
    options = spec.get("gcsFaultToleranceOptions")
    if options is None:
        return [f"{where}: no gcsFaultToleranceOptions: the GCS's tables die with the head"]
    problems = []
    host, _, port = (options.get("redisAddress") or "").rpartition(":")
    services = {
        o["metadata"]["name"]: {p["port"] for p in o["spec"].get("ports") or []}
        for o in objects
        if o["kind"] == "Service"
    }
    if not port.isdigit() or int(port) not in services.get(host, set()):
        problems.append(
            f"{where}: redisAddress {options.get('redisAddress')!r} is no Service port of the build"
        )
    password = options.get("redisPassword") or {}
    if "value" in password or "secretKeyRef" not in (password.get("valueFrom") or {}):
        problems.append(f"{where}: the Redis password must come from a Secret (redisPassword.valueFrom)")
    if (spec["headGroupSpec"].get("rayStartParams") or {}).get("num-cpus") != "0":
        problems.append(f"{where}: the head must keep num-cpus 0 (no training there)")
    try:
        offers = {name: group_resources(group) for name, group, _ in starting_groups(spec)}
    except ValueError as exc:
        return problems + [f"{where}: {exc}"]
    groups = {name: group for name, group, _ in starting_groups(spec)}
    for job in (o for o in objects if o["kind"] == "RayJob"):
        demand, asked_problems = entrypoint_demand(job["spec"])
        custom = {key for key in demand if key not in ("CPU", "GPU")}
        if asked_problems or not custom:
            problems += [f"{name_of(job)}: {p}" for p in asked_problems] or [
                f"{name_of(job)}: asks for no resource of the drivers' group: its driver runs on the head"
            ]
            continue
        hosts = [name for name, offer in offers.items() if custom <= set(offer)]
        if len(hosts) != 1 or hosts[0] == "head":
            problems.append(
                f"{name_of(job)}: {sorted(custom)} must be offered by one worker group, not {hosts}"
            )
            continue
        group = groups[hosts[0]]
        if not 1 <= group.get("minReplicas", 0) == group.get("maxReplicas", 0):
            problems.append(
                f"{where}: group {hosts[0]} (the drivers') needs minReplicas = maxReplicas >= 1: always there"
            )
        if offers[hosts[0]]["CPU"] or offers[hosts[0]]["GPU"]:
            problems.append(
                f"{where}: group {hosts[0]} (the drivers') must offer no CPUs or GPUs: training would go there"
            )
        backoff = (job["spec"].get("submitterConfig") or {}).get("backoffLimit", 2)
        if submitter_patience_s(backoff) < GCS_RECONNECT_S:
            problems.append(
                f"{name_of(job)}: submitterConfig.backoffLimit {backoff} gives up "
                f"{submitter_patience_s(backoff):g} s after the head's loss, before the other pods do "
                f"({GCS_RECONNECT_S} s): KubeRay would fail the job and start it over on a new cluster"
            )
    return problems
