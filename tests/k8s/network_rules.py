"""NetworkPolicies read as Kubernetes applies them: which pods a policy selects, who may reach a
pod on a port, and where a pod may connect to (matchLabels selectors only)."""

from __future__ import annotations

from tests.k8s.rules import ray_cluster_specs
from tests.k8s.schemas import Object, name_of


def selects(selector: Object, labels: dict[str, str]) -> bool:
    if set(selector) - {"matchLabels"}:
        raise AssertionError(f"this check reads matchLabels only, not {sorted(selector)}")
    return all(labels.get(key) == value for key, value in (selector.get("matchLabels") or {}).items())


def ingress_peers(policies: list[Object], labels: dict[str, str], port: int) -> list[Object] | None:
    """The peers that the NetworkPolicies let reach a pod with these labels on a TCP port; None when
    no policy selects the pod (everything may reach it)."""
    chosen = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], labels)
    ]
    if not chosen:
        return None
    peers = []
    for policy in chosen:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
                continue
            peers.extend(rule.get("from") or [{"anyone": True}])  # a rule without `from` admits all
    return peers


def pod_labels(objects: tuple[Object, ...]) -> dict[str, dict[str, str]]:
    """The labels of every kind of pod a build makes, by a short role name."""
    found = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            found[obj["metadata"]["name"]] = obj["spec"]["template"]["metadata"]["labels"]
        for where, spec in ray_cluster_specs(obj):
            head = spec["headGroupSpec"]["template"]["metadata"]["labels"]
            found[f"{where} head"] = {**head, "ray.io/node-type": "head"}
            for group in spec.get("workerGroupSpecs") or []:
                labels = group["template"]["metadata"]["labels"]
                found[f"{where} {group['groupName']}"] = {**labels, "ray.io/node-type": "worker"}
            if spec.get("gcsFaultToleranceOptions") is not None:
                # KubeRay's Redis clean-up Job, run when the cluster is deleted: the head's pod
                # template with another node type.
                found[f"{where} redis-cleanup"] = {**head, "ray.io/node-type": "redis-cleanup"}
        if obj["kind"] == "RayJob":
            found[f"{name_of(obj)} submitter"] = obj["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    return found


def egress_allowed(policies: list[Object], labels: dict[str, str], to: dict[str, str], port: int) -> bool:
    """Whether the NetworkPolicies let a pod with `labels` open a TCP connection to a pod of this
    namespace with labels `to` on `port` (allowed where no policy restricts its egress)."""
    chosen = [
        p
        for p in policies
        # Without policyTypes, a policy restricts egress where it has egress rules.
        if "Egress" in p["spec"].get("policyTypes", ["Egress"] if "egress" in p["spec"] else [])
        and selects(p["spec"]["podSelector"], labels)
    ]
    if not chosen:
        return True
    for policy in chosen:
        for rule in policy["spec"].get("egress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
                continue
            peers = rule.get("to")
            if not peers or any(
                set(peer) == {"podSelector"} and selects(peer["podSelector"], to) for peer in peers
            ):
                return True
    return False


def only_from(peers: list[Object] | None, allowed: set[str], pods: dict[str, dict[str, str]]) -> list[str]:
    """Problems unless every peer is a pod selector (this namespace) that selects allowed pods only."""
    if peers is None:
        return ["no NetworkPolicy selects it: every pod may reach it"]
    problems = []
    for peer in peers:
        if set(peer) != {"podSelector"}:
            problems.append(f"peer {peer} is not a pod selector of this namespace")
            continue
        reached = {role for role, labels in pods.items() if selects(peer["podSelector"], labels)}
        if reached - allowed:
            problems.append(f"peer {peer} also admits {sorted(reached - allowed)}")
    return problems
