"""The Kubernetes deployment (k8s/, Dockerfile), checked offline: every kustomization builds, every
object passes Kubernetes' or KubeRay's schema with unknown fields refused, and the project's rules
hold (versions agree, jobs resume, containers locked down, Secrets never committed, NetworkPolicies
admit only whom they should). The last tests break objects on purpose to show the checks refuse them."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from packaging.requirements import Requirement

from tests.k8s import ha_rules, network_rules, rules, schemas
from tests.k8s.schemas import K8S, build, of_kind

BUILDS = schemas.kustomizations()
OVERLAYS = [K8S / "overlays" / "cpu", K8S / "overlays" / "gpu", K8S / "overlays" / "cpu-ha"]
PIPELINES = sorted(p.name for p in (REPO / "pipelines").glob("*.yaml"))
DOC = REPO / "docs" / "kubernetes.md"


def _id(path: Path) -> str:
    return str(path.relative_to(K8S))


def ray_version() -> str:
    """The Ray version of the Dockerfile's base image (its RAY_VERSION default)."""
    found = re.search(r"^ARG RAY_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert found, "the Dockerfile must declare ARG RAY_VERSION=X.Y.Z before FROM"
    return found.group(1)


@pytest.fixture(params=BUILDS, ids=_id)
def objects(request) -> tuple[dict, ...]:
    return build(request.param)


def test_the_expected_kustomizations_exist():
    assert {_id(p) for p in BUILDS} >= {"base", "overlays/cpu", "overlays/gpu", "overlays/cpu-ha"}


def test_every_object_passes_its_schema_strictly(objects):
    problems = [p for obj in objects for p in schemas.schema_problems(obj)]
    assert not problems, "\n".join(problems)


def test_every_container_is_locked_down(objects):
    problems = [p for obj in objects for p in rules.security_problems(obj)]
    assert not problems, "\n".join(problems)


def test_every_namespaced_object_lands_in_the_namespace(objects):
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == rules.NAMESPACE, schemas.name_of(obj)
    assert [ns["metadata"]["name"] for ns in of_kind(objects, "Namespace")] == [rules.NAMESPACE]
    labels = of_kind(objects, "Namespace")[0]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_ray_versions_agree_with_pyproject(objects):
    version = ray_version()
    pyproject = (REPO / "pyproject.toml").read_text()
    ray_pin = next(Requirement(r) for r in re.findall(r'"(ray\[[^"]+)"', pyproject))
    assert version in ray_pin.specifier, f"Dockerfile's Ray {version} is outside pyproject's pin {ray_pin}"
    for cluster in of_kind(objects, "RayCluster"):
        assert cluster["spec"]["rayVersion"] == version, schemas.name_of(cluster)
    for job in of_kind(objects, "RayJob"):
        assert job["spec"]["rayClusterSpec"]["rayVersion"] == version, schemas.name_of(job)
    for obj in objects:
        for image in rules.images(obj):
            if rules.image_repository(image) == rules.IMAGE:
                assert image.split(":")[-1] in (f"ray{version}", f"ray{version}-gpu"), (
                    schemas.name_of(obj),
                    image,
                )


def test_the_ray_cluster(objects):
    clusters = of_kind(objects, "RayCluster")
    assert [c["metadata"]["name"] for c in clusters] == ["towerflow"]
    problems = rules.raycluster_problems(clusters[0], ray_version())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_id)
def test_one_rayjob_per_pipeline_that_resumes_and_fits_its_cluster(overlay):
    objects = build(overlay)
    jobs = of_kind(objects, "RayJob")
    named = sorted(rules.entrypoint_spec(j["spec"]["entrypoint"])[0] for j in jobs)
    assert named == [f"pipelines/{name}" for name in PIPELINES]
    cluster = of_kind(objects, "RayCluster")[0]
    problems = [p for job in jobs for p in rules.rayjob_problems(job, cluster)]
    assert not problems, "\n".join(problems)
    # Only the RayJobs carry the pipeline label that docs/kubernetes.md selects them by.
    for obj in objects:
        pipeline = obj["metadata"].get("labels", {}).get("towerflow.io/pipeline")
        assert (pipeline == obj["metadata"]["name"]) if obj["kind"] == "RayJob" else pipeline is None


def test_the_gpu_overlay_has_gpu_workers_and_trains_on_them():
    objects = build(K8S / "overlays" / "gpu")
    groups = {g["groupName"]: g for g in of_kind(objects, "RayCluster")[0]["spec"]["workerGroupSpecs"]}
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["image"].endswith("-gpu")
    assert not any(
        g["template"]["spec"]["containers"][0]["image"].endswith("-gpu")
        for n, g in groups.items()
        if n != "gpu"
    )
    for job in of_kind(objects, "RayJob"):
        assert "cluster.gpus_per_worker=1" in rules.entrypoint_spec(job["spec"]["entrypoint"])[1]
    assert "gpu" not in {
        g["groupName"]
        for g in of_kind(build(K8S / "overlays" / "cpu"), "RayCluster")[0]["spec"]["workerGroupSpecs"]
    }


def test_network_policies_admit_only_whom_they_should(objects):
    policies = of_kind(objects, "NetworkPolicy")
    pods = network_rules.pod_labels(objects)
    ray = {role for role, labels in pods.items() if labels.get("app.kubernetes.io/component") == "ray-node"}
    assert ray, "the Ray pods carry app.kubernetes.io/component: ray-node"
    submitters = {role for role in pods if role.endswith("submitter")}
    assert any(
        p["spec"]["podSelector"] == {}
        and p["spec"]["policyTypes"] == ["Ingress"]
        and not p["spec"].get("ingress")
        for p in policies
    ), "a default-deny ingress policy for the namespace"
    checks = {
        ("towerflow-mlflow", 5000): ray,
        ("towerflow-postgres", 5432): {"towerflow-mlflow"},
    }
    for (role, port), allowed in checks.items():
        problems = network_rules.only_from(
            network_rules.ingress_peers(policies, pods[role], port), allowed, pods
        )
        assert not problems, f"{role}:{port}: {problems}"
    for role in ray:
        peers = network_rules.ingress_peers(policies, pods[role], 6379)
        assert not network_rules.only_from(peers, ray, pods), role
        if role.endswith(" head"):
            # The dashboard: Ray pods, the RayJob submitters and the KubeRay operator's namespace.
            peers = network_rules.ingress_peers(policies, pods[role], 8265)
            others = [p for p in peers if "namespaceSelector" in p]
            assert others and all(p["namespaceSelector"] for p in others), (
                "the operator only, not every namespace"
            )
            assert not network_rules.only_from([p for p in peers if p not in others], ray | submitters, pods)
    if "towerflow-redis" in pods:
        # The GCS's tables: the Ray heads (their GCS) and KubeRay's Redis clean-up Job only.
        gcs = {role for role in ray if role.endswith((" head", " redis-cleanup"))}
        assert any(role.endswith(" redis-cleanup") for role in gcs), "a build with Redis has GCS FT on"
        problems = network_rules.only_from(
            network_rules.ingress_peers(policies, pods["towerflow-redis"], 6379), gcs, pods
        )
        assert not problems, f"towerflow-redis:6379: {problems}"
        for role in gcs:
            assert network_rules.egress_allowed(policies, pods[role], pods["towerflow-redis"], 6379), role
        redis = [
            p for p in policies if network_rules.selects(p["spec"]["podSelector"], pods["towerflow-redis"])
        ]
        assert any("Egress" in p["spec"]["policyTypes"] and not p["spec"].get("egress") for p in redis), (
            "Redis opens no connection"
        )


def test_the_cpu_ha_overlay_survives_the_heads_loss():
    objects = build(K8S / "overlays" / "cpu-ha")
    problems = ha_rules.head_fault_tolerance_problems(objects)
    assert not problems, "\n".join(problems)
    cluster = of_kind(objects, "RayCluster")[0]["spec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert rules.custom_resources(groups["drivers"]) == {"towerflow-driver": 1}
    assert not any(rules.custom_resources(g) for n, g in groups.items() if n != "drivers")
    assert not rules.custom_resources(cluster["headGroupSpec"])
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for job in of_kind(objects, "RayJob"):
        assert rules.entrypoint_demand(job["spec"]) == ({"towerflow-driver": 1.0}, []), schemas.name_of(job)
    # The CPU workers are the cpu overlay's: the jobs' capacity is what it was.
    cpu = of_kind(build(K8S / "overlays" / "cpu"), "RayCluster")[0]["spec"]
    assert groups["cpu"] == cpu["workerGroupSpecs"][0]
    assert rules.starting_capacity(cluster) == rules.starting_capacity(cpu)
    # Opt-in: the other overlays keep their GCS in the head and their drivers on it.
    for overlay in (K8S / "overlays" / "cpu", K8S / "overlays" / "gpu"):
        assert ha_rules.head_fault_tolerance_problems(build(overlay))
        assert not any("towerflow-redis" in schemas.name_of(o) for o in build(overlay))


def test_no_secret_values_in_the_repository():
    for path in K8S.rglob("*.yaml"):
        # Wherever an object sits: a manifest, a kustomization, a patch (a JSON patch is a list).
        for node in rules.walk_dicts(list(yaml.safe_load_all(path.read_text()))):
            assert "secretGenerator" not in node, f"{path}: Secrets are created by hand, not generated"
            if node.get("kind") == "Secret":
                assert not node.get("data") and not node.get("stringData"), f"{path}: a Secret with values"


def test_the_doc_creates_every_secret_the_manifests_read():
    refs = set()
    for overlay in OVERLAYS:
        for obj in build(overlay):
            refs |= rules.secret_refs(obj)
    text = DOC.read_text().replace("\\\n", " ")
    created = set()
    for line in text.splitlines():
        found = re.search(r"create secret generic (\S+)", line)
        if found:
            created |= {(found.group(1), key) for key in re.findall(r"--from-literal=([\w.-]+)=", line)}
    assert refs <= created, f"read by the manifests, never created in {DOC.name}: {sorted(refs - created)}"


def test_the_dockerfile_builds_the_image_the_manifests_run():
    text = (REPO / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    froms = [line for line in lines if line.startswith("FROM ")]
    assert froms == ["FROM rayproject/ray:${RAY_VERSION}-${RAY_IMAGE_VARIANT}"]
    assert "ARG RAY_IMAGE_VARIANT=py311" in lines and "*gpu*)" in text  # the GPU variant by build argument
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image runs as the non-root ray user"
    assert "pip install --no-cache-dir /tmp/towerflow-src" in text
    workdir = [line.split()[1] for line in lines if line.startswith("WORKDIR ")][-1]
    for folder in ("models", "pipelines"):  # the specs' import strings and paths, in the working directory
        assert any(re.match(rf"COPY .*\b{folder} \./{folder}$", line) for line in lines), folder
    # The pods run in that directory, with the data volume where the specs' data/ paths point.
    for overlay in OVERLAYS:
        for obj in of_kind(build(overlay), "RayCluster"):
            for where, pod in rules.pod_specs(obj):
                ray = pod["containers"][0]
                assert ray["workingDir"] == workdir, where
                assert f"{workdir}/data" in {m["mountPath"] for m in ray["volumeMounts"]}, where
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".venv", "data/", "mlruns", "mlflow.db", ".git", "runs/"} <= ignored


# --- the checks refuse what they should -----------------------------------------------------------


def _cluster(objects):
    return next(o for o in objects if o["kind"] == "RayCluster")


def _head(obj):
    return obj["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _by_name(objects, kind, name):
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _mlflow(objects):
    return _by_name(objects, "Deployment", "towerflow-mlflow")["spec"]["template"]["spec"]


def _shrink(objects, job):
    """No worker pods at start, in the shared cluster and so in the job's copy of it."""
    cluster = _cluster(objects)
    for group in cluster["spec"]["workerGroupSpecs"]:
        group.update(minReplicas=0, replicas=0)
    _by_name(objects, "RayJob", job)["spec"]["rayClusterSpec"] = copy.deepcopy(cluster["spec"])


BREAKAGES = {
    "unknown field in a Ray container": (
        lambda objs: _head(_cluster(objs)).update(imagePullPolcy="Always"),
        lambda objs: schemas.schema_problems(_cluster(objs)),
    ),
    "misspelt RayCluster field": (
        lambda objs: _cluster(objs)["spec"].update(enableInTreeAutoscalling=True),
        lambda objs: schemas.schema_problems(_cluster(objs)),
    ),
    "bad enum in the CRD": (
        lambda objs: _cluster(objs)["spec"]["authOptions"].update(mode="password"),
        lambda objs: schemas.schema_problems(_cluster(objs)),
    ),
    "two env variables of one name": (
        lambda objs: _head(_cluster(objs))["env"].append({"name": "RAY_AUTH_MODE", "value": "token"}),
        lambda objs: schemas.schema_problems(_cluster(objs)),
    ),
    "unknown field in a Deployment": (
        lambda objs: _mlflow(objs)["containers"][0].update(securityContex={}),
        lambda objs: schemas.schema_problems(_by_name(objs, "Deployment", "towerflow-mlflow")),
    ),
    "privilege escalation allowed": (
        lambda objs: _mlflow(objs)["initContainers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        lambda objs: rules.security_problems(_by_name(objs, "Deployment", "towerflow-mlflow")),
    ),
    "no memory limit": (
        lambda objs: _mlflow(objs)["containers"][0]["resources"]["limits"].pop("memory"),
        lambda objs: rules.security_problems(_by_name(objs, "Deployment", "towerflow-mlflow")),
    ),
    "a hostPath volume": (
        lambda objs: _mlflow(objs)["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
        lambda objs: rules.security_problems(_by_name(objs, "Deployment", "towerflow-mlflow")),
    ),
    "a Ray head without probes": (
        lambda objs: _head(_cluster(objs)).pop("readinessProbe"),
        lambda objs: rules.security_problems(_cluster(objs)),
    ),
    "a writable root filesystem": (
        lambda objs: _cluster(objs)["spec"]["autoscalerOptions"]["securityContext"].pop(
            "readOnlyRootFilesystem"
        ),
        lambda objs: rules.security_problems(_cluster(objs)),
    ),
    "a committed Secret": (
        lambda objs: objs.append(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}, "data": {"k": "dg=="}}
        ),
        lambda objs: rules.security_problems(objs[-1]),
    ),
    "a literal password": (
        lambda objs: _head(_cluster(objs))["env"].append(
            {"name": "MLFLOW_TRACKING_PASSWORD", "value": "hunter2"}
        ),
        lambda objs: rules.security_problems(_cluster(objs)),
    ),
    "a job that would start over": (
        lambda objs: _by_name(objs, "RayJob", "mnist-sync")["spec"].update(
            entrypoint="python -m towerflow train pipelines/mnist_sync.yaml"
        ),
        lambda objs: rules.rayjob_problems(_by_name(objs, "RayJob", "mnist-sync"), _cluster(objs)),
    ),
    "a job whose cluster is too small at start": (
        lambda objs: _shrink(objs, "ptb-sync"),
        lambda objs: rules.rayjob_problems(_by_name(objs, "RayJob", "ptb-sync"), _cluster(objs)),
    ),
    "a Ray worker group that kills idle workers after 1 s": (
        lambda objs: _cluster(objs)["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][
            0
        ].update(env=[]),
        lambda objs: rules.raycluster_problems(_cluster(objs), ray_version()),
    ),
    "a Ray worker pod that stops its node at once": (
        lambda objs: _cluster(objs)["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
            "lifecycle"
        ]["preStop"]["exec"].update(command=["/bin/sh", "-c", "ray stop"]),
        lambda objs: rules.raycluster_problems(_cluster(objs), ray_version()),
    ),
    "a drain longer than the pod's grace period": (
        lambda objs: _cluster(objs)["spec"]["workerGroupSpecs"][0]["template"]["spec"].update(
            terminationGracePeriodSeconds=30
        ),
        lambda objs: rules.raycluster_problems(_cluster(objs), ray_version()),
    ),
    "a Ray version that is not pinned": (
        lambda objs: _cluster(objs)["spec"].update(rayVersion="2.59.0"),
        lambda objs: rules.raycluster_problems(_cluster(objs), ray_version()),
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_checks_refuse_a_broken_object(breakage):
    objects = copy.deepcopy(list(build(K8S / "overlays" / "cpu")))
    check = BREAKAGES[breakage][1]
    assert not check(objects), "the unbroken build must pass"
    BREAKAGES[breakage][0](objects)
    assert check(objects), f"{breakage} went unnoticed"


def _redis_peers(objects):
    return _by_name(objects, "NetworkPolicy", "towerflow-redis")["spec"]["ingress"][0]["from"]


def _gcs_ft(objects):
    return _cluster(objects)["spec"]["gcsFaultToleranceOptions"]


def _head_params(objects):
    return _cluster(objects)["spec"]["headGroupSpec"]["rayStartParams"]


def _every_job(objects, change):
    for job in (o for o in objects if o["kind"] == "RayJob"):
        change(job["spec"])


def _drivers(objects):
    return next(g for g in _cluster(objects)["spec"]["workerGroupSpecs"] if g["groupName"] == "drivers")


HA_BREAKAGES = {
    "a job whose driver runs on the head": lambda objs: _every_job(
        objs, lambda spec: spec.pop("entrypointResources")
    ),
    "a job that asks for what no pod offers": lambda objs: _every_job(
        objs, lambda spec: spec.update(entrypointResources='{"towerflow-drivers": 1}')
    ),
    "entrypointResources that are not JSON": lambda objs: _every_job(
        objs, lambda spec: spec.update(entrypointResources="towerflow-driver=1")
    ),
    "a submitter that gives up before the head is back": lambda objs: _every_job(
        objs, lambda spec: spec["submitterConfig"].update(backoffLimit=2)
    ),
    "a drivers group the autoscaler may remove": lambda objs: _drivers(objs).update(minReplicas=0),
    "a drivers group that draws training": lambda objs: _drivers(objs)["rayStartParams"].pop("num-cpus"),
    "custom resources not in KubeRay's format": lambda objs: _drivers(objs)["rayStartParams"].update(
        resources='{"towerflow-driver": 1}'
    ),
    "a head that trains": lambda objs: _head_params(objs).update({"num-cpus": "2"}),
    "a Redis password in the manifest": lambda objs: _gcs_ft(objs).update(redisPassword={"value": "hunter2"}),
    "a Redis address that is no Service": lambda objs: _gcs_ft(objs).update(redisAddress="redis:6379"),
}


@pytest.mark.parametrize("breakage", HA_BREAKAGES)
def test_the_head_fault_tolerance_checks_refuse_a_broken_build(breakage):
    objects = copy.deepcopy(list(build(K8S / "overlays" / "cpu-ha")))
    assert not ha_rules.head_fault_tolerance_problems(objects), "the unbroken build must pass"
    HA_BREAKAGES[breakage](objects)
    assert ha_rules.head_fault_tolerance_problems(objects), f"{breakage} went unnoticed"


def test_a_job_whose_driver_finds_no_pod_is_refused():
    objects = copy.deepcopy(list(build(K8S / "overlays" / "cpu-ha")))
    job = _by_name(objects, "RayJob", "mnist-sync")
    assert not rules.rayjob_problems(job, _cluster(objects))
    job["spec"]["entrypointResources"] = '{"towerflow-driver": 2}'
    assert rules.rayjob_problems(job, _cluster(objects))


def test_a_redis_reachable_from_the_workers_is_refused():
    objects = copy.deepcopy(list(build(K8S / "overlays" / "cpu-ha")))
    pods = network_rules.pod_labels(tuple(objects))
    gcs = {role for role in pods if role.endswith((" head", " redis-cleanup"))}
    policies = of_kind(objects, "NetworkPolicy")
    assert not network_rules.only_from(
        network_rules.ingress_peers(policies, pods["towerflow-redis"], 6379), gcs, pods
    )
    _redis_peers(objects).append(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "ray-node"}}}
    )
    assert network_rules.only_from(
        network_rules.ingress_peers(policies, pods["towerflow-redis"], 6379), gcs, pods
    )


def test_a_head_that_may_not_reach_redis_is_refused():
    objects = copy.deepcopy(list(build(K8S / "overlays" / "cpu-ha")))
    pods = network_rules.pod_labels(tuple(objects))
    head = next(labels for role, labels in pods.items() if role.endswith(" head"))
    assert network_rules.egress_allowed(
        of_kind(objects, "NetworkPolicy"), head, pods["towerflow-redis"], 6379
    )
    deny = {
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "ray-node"}},
        "policyTypes": ["Egress"],
    }
    objects.append({"kind": "NetworkPolicy", "metadata": {"name": "deny-egress"}, "spec": deny})
    assert not network_rules.egress_allowed(
        of_kind(objects, "NetworkPolicy"), head, pods["towerflow-redis"], 6379
    )


def test_a_database_reachable_from_anywhere_is_refused():
    objects = copy.deepcopy(list(build(K8S / "overlays" / "cpu")))
    pods = network_rules.pod_labels(tuple(objects))
    policies = of_kind(objects, "NetworkPolicy")
    postgres = _by_name(objects, "NetworkPolicy", "towerflow-postgres")
    postgres["spec"]["ingress"][0]["from"].append({"podSelector": {}})
    peers = network_rules.ingress_peers(policies, pods["towerflow-postgres"], 5432)
    assert network_rules.only_from(peers, {"towerflow-mlflow"}, pods)
