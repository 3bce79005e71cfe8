"""The NetworkPolicy: Kubernetes' label selectors and ingress rules, evaluated offline for the pods lesson 08 asks
about."""

from __future__ import annotations

from helpers.tooling.kuberay.reference import load_manifest

#: The ports lesson 08 asks about: the dashboard's (Jobs API) and the GCS's, on the head pod.
DASHBOARD_PORT, GCS_PORT = 8265, 6379
#: Who should reach the course's Ray pods on each port: (who, pod labels, namespace, reaches 8265, reaches 6379).
REACH_EXPECTED = [
    ("a pod of the course's Ray clusters", {"app.kubernetes.io/part-of": "ray-course", "ray.io/node-type": "worker"},
     "default", True, True),
    ("the KubeRay operator", {"app.kubernetes.io/name": "kuberay-operator"}, "default", True, False),
    ("the RayJob's submitter pod", {"batch.kubernetes.io/job-name": "ray-course-train"}, "default", True, False),
    ("a pod labelled ray-course/jobs-client", {"ray-course/jobs-client": "true"}, "default", True, False),
    ("any other pod in this namespace", {"app": "web"}, "default", False, False),
    ("a Ray pod in another namespace", {"app.kubernetes.io/part-of": "ray-course"}, "other", False, False),
]


def selects(selector: dict | None, labels: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) matches `labels`; {} matches all."""
    selector = selector or {}
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        matches = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
                   "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not matches:
            return False
    return True


def admits(policy: dict, labels: dict, namespace: str, port: int, policy_namespace: str = "default") -> bool:
    """Whether `policy` lets a pod with `labels` in `namespace` open a TCP connection to `port` of a pod it selects.

    Kubernetes' rules: the selected pods accept only what some ingress rule allows; a rule allows its `from` peers
    (none listed: everyone) on its `ports` (none listed: all). A peer's podSelector alone means pods of the policy's
    own namespace; with a namespaceSelector in the same entry, both must match. `ipBlock` peers are not pods.
    """
    spec = policy["spec"]
    if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
        return True
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in spec.get("ingress") or []:
        ports = rule.get("ports") or [{}]
        if not any(p.get("port") is None or p["port"] == port or p["port"] <= port <= p.get("endPort", p["port"])
                   for p in ports if p.get("protocol", "TCP") == "TCP"):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                continue
            in_namespace = (selects(peer["namespaceSelector"], namespace_labels) if "namespaceSelector" in peer
                            else namespace == policy_namespace)
            if in_namespace and selects(peer.get("podSelector"), labels):
                return True
    return False


def reach_cases() -> list[tuple]:
    """REACH_EXPECTED, with the submitter pod labelled by the name of the RayJob in rayjob.yaml (its Job's name)."""
    submitter = {"batch.kubernetes.io/job-name": load_manifest("rayjob.yaml")["metadata"]["name"]}
    return [(who, submitter if "batch.kubernetes.io/job-name" in labels else labels, *rest)
            for who, labels, *rest in REACH_EXPECTED]


def print_reach(policy: dict) -> None:
    """Who the policy lets reach the dashboard's and the GCS's ports of the course's Ray pods."""
    print(f"{'from':<38} {DASHBOARD_PORT} (Jobs API)  {GCS_PORT} (GCS)")
    for who, labels, namespace, _, _ in reach_cases():
        reach = ["yes" if admits(policy, labels, namespace, port) else "no" for port in (DASHBOARD_PORT, GCS_PORT)]
        print(f"{who:<38} {reach[0]:<16} {reach[1]}")


def networkpolicy_errors(policy: dict) -> list[str]:
    """The policy protects every Ray pod of the course, and admits exactly the clients REACH_EXPECTED names."""
    errors = []
    templates = [load_manifest("raycluster.yaml")["spec"], load_manifest("rayjob.yaml")["spec"]["rayClusterSpec"]]
    for spec in templates:
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            labels = group["template"].get("metadata", {}).get("labels", {})
            if not selects(policy["spec"]["podSelector"], labels):
                errors.append(f"spec.podSelector: does not select the pods of group {group.get('groupName', 'head')}"
                              f" (their labels: {labels})")
                break
    for who, labels, namespace, *expected in reach_cases():
        for port, should in zip((DASHBOARD_PORT, GCS_PORT), expected):
            if admits(policy, labels, namespace, port) != should:
                errors.append(f"spec.ingress: {who} {'cannot' if should else 'can'} reach port {port}"
                              f"{'' if should else ', and it should not'}")
    return errors

