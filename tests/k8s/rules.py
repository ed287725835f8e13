"""The project's rules for the objects k8s/ builds, as functions that return the problems they find
(an empty list: none), so that each rule can also be shown to refuse a broken object."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from typing import Any

from conftest import REPO

from tests.k8s.schemas import Object, name_of
from towerflow.runtime.cluster import RAY_NODE_ENV

NAMESPACE = "towerflow"
IMAGE = "towerflow"  # the image the Dockerfile builds, by the name the manifests use
MLFLOW_URI = "http://towerflow-mlflow:5000"
# KubeRay names a RayJob's cluster and services after it; it refuses longer names (MaxRayJobNameLength).
MAX_RAYJOB_NAME = 47
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SECRETISH = re.compile(r"PASSWORD|TOKEN|SECRET|CREDENTIAL|_KEY$")


# --- pods and containers ------------------------------------------------------------------------


def pod_specs(obj: Object) -> Iterator[tuple[str, Object]]:
    """Every pod spec in an object, wherever it sits: a Deployment's template, a RayCluster's head
    and worker groups, a RayJob's cluster and submitter."""

    def walk(node: Any, path: str) -> Iterator[tuple[str, Object]]:
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                yield path, node
            for key, value in node.items():
                yield from walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from walk(value, f"{path}[{index}]")

    yield from walk(obj, name_of(obj))


def ray_cluster_specs(obj: Object) -> list[tuple[str, Object]]:
    if obj["kind"] == "RayCluster":
        return [(name_of(obj), obj["spec"])]
    if obj["kind"] == "RayJob" and "rayClusterSpec" in obj["spec"]:
        return [(f"{name_of(obj)}.spec.rayClusterSpec", obj["spec"]["rayClusterSpec"])]
    return []


def is_ray_node(where: str) -> bool:
    """A Ray head or worker pod (the first container is Ray's, and a server)."""
    return ("headGroupSpec" in where or "workerGroupSpecs" in where) and "submitterPodTemplate" not in where


def container_problems(where: str, container: Object, pod: Object) -> list[str]:
    problems = []
    security = container.get("securityContext") or {}
    if security.get("runAsNonRoot") is not True:
        problems.append(f"{where}: securityContext.runAsNonRoot must be true")
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: securityContext.allowPrivilegeEscalation must be false")
    if "ALL" not in ((security.get("capabilities") or {}).get("drop") or []):
        problems.append(f"{where}: securityContext.capabilities.drop must include ALL")
    if security.get("privileged"):
        problems.append(f"{where}: must not be privileged")
    if security.get("readOnlyRootFilesystem") is not True:
        problems.append(
            f"{where}: securityContext.readOnlyRootFilesystem must be true (mount an emptyDir where it writes)"
        )
    user = security.get("runAsUser", (pod.get("securityContext") or {}).get("runAsUser"))
    if user == 0:
        problems.append(f"{where}: runs as uid 0")
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):
        missing = [r for r in ("cpu", "memory") if r not in (resources.get(kind) or {})]
        if missing:
            problems.append(f"{where}: resources.{kind} lacks {', '.join(missing)}")
    if image_repository(container.get("image", "")) == IMAGE and security.get("readOnlyRootFilesystem"):
        # Ray, MLflow and towerflow write under /tmp: it must be a writable emptyDir.
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        tmp = [m for m in container.get("volumeMounts") or [] if m.get("mountPath") == "/tmp"]
        if not tmp or "emptyDir" not in volumes.get(tmp[0]["name"], {}):
            problems.append(f"{where}: a read-only root filesystem needs an emptyDir mounted at /tmp")
    return problems


def pod_problems(where: str, pod: Object) -> list[str]:
    problems = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            problems.append(f"{where}: {flag} is not allowed")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            problems.append(f"{where}: volume {volume['name']} is a hostPath")
    security = pod.get("securityContext") or {}
    if security.get("runAsNonRoot") is not True:
        problems.append(f"{where}: pod securityContext.runAsNonRoot must be true")
    if (security.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        problems.append(
            f"{where}: pod securityContext.seccompProfile.type must be RuntimeDefault (PSA restricted)"
        )
    for field in ("initContainers", "containers"):
        for index, container in enumerate(pod.get(field) or []):
            at = f"{where}.{field}[{index}]({container.get('name')})"
            problems += container_problems(at, container, pod)
            serves = bool(container.get("ports")) or (
                field == "containers" and index == 0 and is_ray_node(where)
            )
            for probe in ("readinessProbe", "livenessProbe"):
                if serves and not container.get(probe):
                    problems.append(f"{at}: a server needs a {probe}")
    return problems


def security_problems(obj: Object) -> list[str]:
    """The rules for every container of an object, KubeRay's autoscaler sidecar included (it is
    made from autoscalerOptions)."""
    problems = []
    for where, pod in pod_specs(obj):
        problems += pod_problems(where, pod)
    for where, spec in ray_cluster_specs(obj):
        options = spec.get("autoscalerOptions")
        if spec.get("enableInTreeAutoscaling") and options is not None:
            head_pod = spec["headGroupSpec"]["template"]["spec"]
            autoscaler = {"image": IMAGE, **options}
            problems += container_problems(f"{where}.autoscalerOptions", autoscaler, head_pod)
        elif spec.get("enableInTreeAutoscaling"):
            problems.append(
                f"{where}: autoscalerOptions must give the autoscaler a securityContext and resources"
            )
    if obj["kind"] == "Secret" and (obj.get("data") or obj.get("stringData")):
        problems.append(
            f"{name_of(obj)}: a Secret with values; reference Secrets by name, create them by hand"
        )
    for env in walk_dicts(obj):
        if (
            "name" in env
            and "value" in env
            and SECRETISH.search(str(env["name"]))
            and isinstance(env["value"], str)
        ):
            problems.append(
                f"{name_of(obj)}: {env['name']} has a literal value; take it from a Secret (secretKeyRef)"
            )
    return problems


def walk_dicts(node: Any) -> Iterator[Object]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk_dicts(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk_dicts(value)


def image_repository(image: str) -> str:
    """registry/path/name:tag -> name."""
    return image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]


def images(obj: Object) -> list[str]:
    found = [
        c["image"]
        for _, pod in pod_specs(obj)
        for f in ("initContainers", "containers")
        for c in pod.get(f) or []
    ]
    return found + [
        (spec.get("autoscalerOptions") or {}).get("image", "") for _, spec in ray_cluster_specs(obj)
    ]


def secret_refs(obj: Object) -> set[tuple[str, str]]:
    """(Secret, key) for every secretKeyRef, and the Ray token Secret that authOptions names."""
    refs = {
        (d["secretKeyRef"]["name"], d["secretKeyRef"]["key"]) for d in walk_dicts(obj) if "secretKeyRef" in d
    }
    for _, spec in ray_cluster_specs(obj):
        if (spec.get("authOptions") or {}).get("secretName"):
            refs.add((spec["authOptions"]["secretName"], "auth_token"))  # the key KubeRay reads
    return refs


# --- Ray clusters and jobs ----------------------------------------------------------------------


def quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def node_capacity(group: Object) -> tuple[float, float]:
    """(CPUs, GPUs) that Ray sees on one pod of a group: rayStartParams, else the Ray container's limits."""
    params = group.get("rayStartParams") or {}
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    cpus = quantity(params.get("num-cpus", limits.get("cpu", 0)))
    gpus = quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    return cpus, gpus


def custom_resources(group: Object) -> dict[str, float]:
    """The custom resources a group's pods offer Ray, from rayStartParams["resources"] in KubeRay's
    format (a JSON object inside a quoted string, '"{\\"name\\": 1}"'), read as Ray's autoscaler
    reads it: the outer quotes dropped, the backslashes removed, whole numbers only. Raises
    ValueError for a value that is not in that format."""
    text = (group.get("rayStartParams") or {}).get("resources")
    if text is None:
        return {}
    try:
        found = json.loads(text[1:-1].replace("\\", ""))
    except json.JSONDecodeError as exc:
        raise ValueError(f"rayStartParams.resources {text!r} is not '\"{{...}}\"' JSON: {exc}") from None
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in found.items()
    ):
        raise ValueError(f"rayStartParams.resources {text!r} must map names to whole numbers")
    return {name: float(amount) for name, amount in found.items()}


def group_resources(group: Object) -> dict[str, float]:
    """What one pod of a group offers Ray: CPUs, GPUs and custom resources."""
    cpus, gpus = node_capacity(group)
    return {"CPU": cpus, "GPU": gpus, **custom_resources(group)}


def starting_groups(cluster: Object) -> list[tuple[str, Object, int]]:
    """(name, group, pods at start) for the head ("head") and each worker group at minReplicas."""
    groups = [("head", cluster["headGroupSpec"], 1)]
    return groups + [
        (group["groupName"], group, group.get("minReplicas", 0))
        for group in cluster.get("workerGroupSpecs") or []
    ]


def entrypoint_demand(job_spec: Object) -> tuple[dict[str, float], list[str]]:
    """(what a RayJob's entrypoint asks of the node it runs on, problems): entrypointNumCpus,
    entrypointNumGpus and the JSON object of entrypointResources. Nothing asked: Ray runs the
    entrypoint on the head."""
    demand = {
        name: float(job_spec[field])
        for name, field in (("CPU", "entrypointNumCpus"), ("GPU", "entrypointNumGpus"))
        if job_spec.get(field)
    }
    text = job_spec.get("entrypointResources")
    if text is None:
        return demand, []
    try:
        asked = json.loads(text)
    except json.JSONDecodeError as exc:
        return demand, [f"entrypointResources {text!r} is not JSON: {exc}"]
    if not isinstance(asked, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in asked.values()
    ):
        return demand, [f"entrypointResources {text!r} must map resource names to amounts"]
    if set(asked) & {"CPU", "GPU", "memory"}:
        return demand, [f"entrypointResources {text!r}: ask for CPUs, GPUs and memory with their own fields"]
    return {**demand, **{name: float(amount) for name, amount in asked.items()}}, []


def entrypoint_problems(where: str, job_spec: Object) -> list[str]:
    """A RayJob whose entrypoint asks for resources must find them on one pod that is there at start
    (the head or a worker group's minReplicas): its driver starts at once rather than waiting for
    the autoscaler."""
    demand, problems = entrypoint_demand(job_spec)
    if problems or not demand:
        return [f"{where}: {p}" for p in problems]
    cluster = job_spec["rayClusterSpec"]
    try:
        hosts = [
            name
            for name, group, count in starting_groups(cluster)
            if count >= 1
            and all(group_resources(group).get(key, 0.0) + 1e-9 >= amount for key, amount in demand.items())
        ]
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if not hosts:
        return [f"{where}: no pod there at start offers what its entrypoint asks for ({demand})"]
    return []


def starting_nodes(cluster: Object) -> list[dict[str, float]]:
    """Each node's resources as Ray counts them, with each worker group at minReplicas: what a job
    finds at start, before the autoscaler adds anything."""
    nodes = []
    for _, group, count in starting_groups(cluster):
        cpus, gpus = node_capacity(group)
        nodes += [{"CPU": cpus, "GPU": gpus}] * count
    return nodes


def starting_capacity(cluster: Object) -> tuple[float, float]:
    """The CPUs and GPUs a cluster has at start (starting_nodes)."""
    nodes = starting_nodes(cluster)
    return sum(n["CPU"] for n in nodes), sum(n["GPU"] for n in nodes)


def entrypoint_spec(entrypoint: str) -> tuple[str | None, list[str], list[str]]:
    """(spec path, --set overrides, problems) of `python -m towerflow train SPEC ... --resume auto`."""
    argv = shlex.split(entrypoint)
    problems = []
    if argv[:4] != ["python", "-m", "towerflow", "train"] or len(argv) < 5:
        return None, [], [f"entrypoint {entrypoint!r} is not `python -m towerflow train SPEC ...`"]
    overrides, index = [], 5
    while index < len(argv):
        if argv[index] == "--set":
            index += 1
            while index < len(argv) and not argv[index].startswith("--"):
                overrides.append(argv[index])
                index += 1
        else:
            index += 1
    if not any(argv[i : i + 2] == ["--resume", "auto"] for i in range(len(argv))):
        problems.append(f"entrypoint {entrypoint!r} lacks `--resume auto`: a retry would start the run over")
    return argv[4], overrides, problems


def rayjob_problems(job: Object, cluster: Object) -> list[str]:
    """A RayJob against the rules, and against the shared RayCluster `cluster` of the same build."""
    from towerflow.runtime.cluster import budget_for
    from towerflow.runtime.worker_cpus import joined_worker_cpus
    from towerflow.spec import load_spec

    where, spec = name_of(job), job["spec"]
    name = job["metadata"]["name"]
    problems = []
    if not DNS_1035.match(name) or len(name) > MAX_RAYJOB_NAME:
        problems.append(f"{where}: KubeRay wants a DNS-1035 name of at most {MAX_RAYJOB_NAME} characters")
    wanted = {"submissionMode": "K8sJobMode", "shutdownAfterJobFinishes": True}
    problems += [f"{where}: {k} must be {v!r}" for k, v in wanted.items() if spec.get(k) != v]
    for field in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished"):
        if not isinstance(spec.get(field), int) or spec[field] < (
            0 if field == "ttlSecondsAfterFinished" else 1
        ):
            problems.append(f"{where}: {field} must be set")
    if "clusterSelector" in spec or spec.get("rayClusterSpec") != cluster["spec"]:
        problems.append(
            f"{where}: its rayClusterSpec must be the RayCluster {cluster['metadata']['name']}'s spec"
        )
        return problems
    problems += entrypoint_problems(where, spec)
    spec_path, overrides, entry_problems = entrypoint_spec(spec.get("entrypoint", ""))
    problems += [f"{where}: {p}" for p in entry_problems]
    if spec_path is None:
        return problems
    if not spec_path.startswith("pipelines/") or not (REPO / spec_path).is_file():
        return problems + [f"{where}: {spec_path} is not a pipeline file in pipelines/"]
    # The job joins the RayCluster: cpus_per_worker: auto resolves as it will there, on an idle cluster.
    job_spec = load_spec(REPO / spec_path, overrides)
    cpus, gpus = starting_capacity(spec["rayClusterSpec"])
    if job_spec.cluster.cpus_per_worker == "auto":
        auto = joined_worker_cpus(job_spec.cluster, starting_nodes(spec["rayClusterSpec"]), cpus)
        job_spec.cluster.cpus_per_worker = float(auto)
    needed = budget_for(job_spec.cluster, job_spec.cluster.fewest_workers)
    if cpus + 1e-9 < needed.cpus or gpus + 1e-9 < needed.gpus:
        problems.append(
            f"{where}: {spec_path} needs {needed.cpus:g} CPUs and {needed.gpus:g} GPUs at start, but the "
            f"cluster starts with {cpus:g} and {gpus:g} (towerflow does not wait for the autoscaler)"
        )
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head.get("env") or []}
    if env.get("MLFLOW_TRACKING_URI", {}).get("value") != MLFLOW_URI:
        problems.append(f"{where}: the head's MLFLOW_TRACKING_URI must be {MLFLOW_URI}")
    if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
        problems.append(f"{where}: the head's RAY_AUTH_MODE must be token")
    for secret in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        if "secretKeyRef" not in (env.get(secret, {}).get("valueFrom") or {}):
            problems.append(f"{where}: the head's {secret} must come from a Secret")
    return problems


def raycluster_problems(cluster: Object, ray_version: str) -> list[str]:
    where, spec = name_of(cluster), cluster["spec"]
    problems = []
    if spec.get("rayVersion") != ray_version:
        problems.append(f"{where}: rayVersion {spec.get('rayVersion')!r} is not the pinned Ray {ray_version}")
    if spec.get("authOptions", {}).get("mode") != "token" or not spec["authOptions"].get("secretName"):
        problems.append(f"{where}: authOptions must be mode token with a secretName")
    if (
        spec.get("enableInTreeAutoscaling") is not True
        or spec.get("autoscalerOptions", {}).get("version") != "v2"
    ):
        problems.append(
            f"{where}: autoscaler v2 must be on (enableInTreeAutoscaling, autoscalerOptions.version v2)"
        )
    groups = spec.get("workerGroupSpecs") or []
    if not groups:
        problems.append(f"{where}: no worker group")
    for group in groups:
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not (
            isinstance(low, int) and isinstance(high, int) and 0 <= low <= group.get("replicas", low) <= high
        ):
            problems.append(
                f"{where}: group {group['groupName']}: need 0 <= minReplicas <= replicas <= maxReplicas"
            )
    for ray_pod in [spec["headGroupSpec"], *groups]:
        if "app.kubernetes.io/name" in (ray_pod["template"].get("metadata") or {}).get("labels", {}):
            # KubeRay's head services select the head by app.kubernetes.io/name=kuberay.
            problems.append(f"{where}: Ray pod templates must leave app.kubernetes.io/name to KubeRay")
        restart = ray_pod["template"]["spec"].get("restartPolicy")
        if restart not in (None, "Never"):
            problems.append(f"{where}: autoscaler v2 needs restartPolicy Never or unset, not {restart}")
        env = {
            e["name"]: e.get("value") for e in ray_pod["template"]["spec"]["containers"][0].get("env") or []
        }
        group = ray_pod.get("groupName", "head")
        for name, value in RAY_NODE_ENV.items():  # what every Ray node towerflow starts sets
            if env.get(name) != value:
                problems.append(
                    f"{where}: {group}'s Ray container must set {name}={value}, not {env.get(name)}"
                )
    for group in groups:
        problems += _drain_problems(where, group)
    return problems


def _drain_problems(where: str, group: Object) -> list[str]:
    """A worker pod that goes drains its node first (`towerflow cluster leave` as its preStop), for
    less than its grace period: a run with a shard there hears of it (runtime/draining.py)."""
    pod = group["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env") or []}
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    drain_s = float(env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S") or 0)
    grace_s = pod.get("terminationGracePeriodSeconds", 30)
    name = group["groupName"]
    problems = []
    if pre_stop[-3:] != ["towerflow", "cluster", "leave"]:
        problems.append(f"{where}: group {name}'s preStop must be `towerflow cluster leave`, not {pre_stop}")
    if not 0 < drain_s <= grace_s - 10:
        problems.append(
            f"{where}: group {name}: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S ({drain_s:g}) must be set, 10 s "
            f"or more below terminationGracePeriodSeconds ({grace_s})"
        )
    return problems
