"""The NetworkPolicies: Kubernetes' label selectors, ingress and egress rules, evaluated offline for the pods and
addresses lesson 08 asks about."""

from __future__ import annotations

import ipaddress

from helpers.tooling.kuberay.reference import load_manifest

#: The ports lesson 08 asks about: the dashboard's (Jobs API) and the GCS's, on the head pod.
DASHBOARD_PORT, GCS_PORT = 8265, 6379
#: Who should reach the course's Ray pods on each port: (who, pod labels, namespace, reaches 8265, reaches 6379).
REACH_EXPECTED = [
    ("a pod of the course's Ray clusters", {"app.kubernetes.io/part-of": "ray-course", "ray.io/node-type": "worker"},
     "ray-course", True, True),
    ("the KubeRay operator (kuberay-system)", {"app.kubernetes.io/name": "kuberay-operator"}, "kuberay-system", True,
     False),
    ("operator labels, in this namespace", {"app.kubernetes.io/name": "kuberay-operator"}, "ray-course", False, False),
    ("the RayJob's submitter pod", {"batch.kubernetes.io/job-name": "ray-course-train"}, "ray-course", True, False),
    ("a pod labelled ray-course/jobs-client", {"ray-course/jobs-client": "true"}, "ray-course", True, False),
    ("any other pod in this namespace", {"app": "web"}, "ray-course", False, False),
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


def _policy_types(spec: dict) -> list[str]:
    """Kubernetes' default when policyTypes is unset: Ingress, and Egress too when the policy has egress rules."""
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _port_matches(ports: list[dict] | None, port: int, protocol: str) -> bool:
    return not ports or any(
        p.get("protocol", "TCP") == protocol and (p.get("port") is None or p["port"] <= port <= p.get("endPort",
                                                                                                  p["port"]))
        for p in ports)


def _peer_matches(peer: dict, labels: dict | None, namespace: str | None, ip: str | None,
                  policy_namespace: str) -> bool:
    """Whether a `from`/`to` entry matches a pod (labels, namespace) or an address outside the cluster (ip)."""
    if "ipBlock" in peer:  # addresses outside the cluster; pods' own addresses are matched by selectors here
        if ip is None:
            return False
        block = peer["ipBlock"]
        address = ipaddress.ip_address(ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except") or [])
    if labels is None or namespace is None:
        return False
    in_namespace = (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
                    if "namespaceSelector" in peer else namespace == policy_namespace)
    return in_namespace and selects(peer.get("podSelector"), labels)


def admits(policy: dict, labels: dict, namespace: str, port: int, policy_namespace: str = "ray-course") -> bool:
    """Whether `policy` lets a pod with `labels` in `namespace` open a TCP connection to `port` of a pod it selects.

    Kubernetes' rules: the selected pods accept only what some ingress rule allows; a rule allows its `from` peers
    (none listed: everyone) on its `ports` (none listed: all). A peer's podSelector alone means pods of the policy's
    own namespace; with a namespaceSelector in the same entry, both must match. `ipBlock` peers are not pods.
    """
    spec = policy["spec"]
    if "Ingress" not in _policy_types(spec):
        return True
    for rule in spec.get("ingress") or []:
        if not _port_matches(rule.get("ports"), port, "TCP"):
            continue
        peers = rule.get("from")
        if not peers or any(_peer_matches(peer, labels, namespace, None, policy_namespace) for peer in peers):
            return True
    return False


def egress_admits(policy: dict, port: int, protocol: str = "TCP", labels: dict | None = None,
                  namespace: str | None = None, ip: str | None = None, policy_namespace: str = "ray-course") -> bool:
    """Whether `policy` lets the pods it selects open a connection to a pod (`labels` in `namespace`) or to an
    address outside the cluster (`ip`), on `port` and `protocol`. Kubernetes' rules, as `admits` for egress:
    `to` peers (none listed: everywhere) on `ports` (none listed: all)."""
    spec = policy["spec"]
    if "Egress" not in _policy_types(spec):
        return True
    for rule in spec.get("egress") or []:
        if not _port_matches(rule.get("ports"), port, protocol):
            continue
        peers = rule.get("to")
        if not peers or any(_peer_matches(peer, labels, namespace, ip, policy_namespace) for peer in peers):
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


def _selection_errors(policy: dict) -> list[str]:
    templates = [load_manifest("raycluster.yaml")["spec"], load_manifest("rayjob.yaml")["spec"]["rayClusterSpec"]]
    for spec in templates:
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            labels = group["template"].get("metadata", {}).get("labels", {})
            if not selects(policy["spec"]["podSelector"], labels):
                return [f"spec.podSelector: does not select the pods of group {group.get('groupName', 'head')}"
                        f" (their labels: {labels})"]
    return []


def networkpolicy_errors(policy: dict) -> list[str]:
    """The policy protects every Ray pod of the course, and admits exactly the clients REACH_EXPECTED names."""
    errors = _selection_errors(policy)
    for who, labels, namespace, *expected in reach_cases():
        for port, should in zip((DASHBOARD_PORT, GCS_PORT), expected):
            if admits(policy, labels, namespace, port) != should:
                errors.append(f"spec.ingress: {who} {'cannot' if should else 'can'} reach port {port}"
                              f"{'' if should else ', and it should not'}")
    return errors



#: Where the course's Ray pods may connect out, and where not: (what, destination, port, protocol, allowed). A
#: destination is a pod (labels, namespace) or an address; "api-server" and "storage" stand for the addresses of the
#: policy's own ipBlock rules (the API server's is the one on port 443), which you set for your cluster.
EGRESS_EXPECTED = [
    ("the cluster's DNS (kube-dns)", ({"k8s-app": "kube-dns"}, "kube-system"), 53, "UDP", True),
    ("a pod of the course's Ray clusters", ({"app.kubernetes.io/part-of": "ray-course"}, "ray-course"), GCS_PORT, "TCP",
     True),
    ("the Kubernetes API server", "api-server", 443, "TCP", True),
    ("the storage endpoint", "storage", None, "TCP", True),
    ("the cloud metadata endpoint", "169.254.169.254", 80, "TCP", False),
    ("an address on the internet", "203.0.113.7", 443, "TCP", False),
    ("a DNS server outside the cluster", "203.0.113.53", 53, "UDP", False),
    ("any other pod in this namespace", ({"app": "web"}, "ray-course"), 8080, "TCP", False),
    ("the DNS pods, on another port", ({"k8s-app": "kube-dns"}, "kube-system"), 9153, "TCP", False),
    ("a Ray pod in another namespace", ({"app.kubernetes.io/part-of": "ray-course"}, "other"), GCS_PORT, "TCP", False),
]


def _ip_rules(policy: dict) -> dict[str, tuple[str, int | None]]:
    """The first address and port of the policy's ipBlock rules: 'api-server' (the rule on 443), 'storage' (another)."""
    found: dict[str, tuple[str, int | None]] = {}
    for rule in policy["spec"].get("egress") or []:
        ports = [p.get("port") for p in rule.get("ports") or []]
        for peer in rule.get("to") or []:
            if "ipBlock" in peer:
                network = ipaddress.ip_network(peer["ipBlock"]["cidr"])
                address = str(next(iter(network.hosts()), network.network_address))
                found.setdefault("api-server" if 443 in ports else "storage", (address, ports[0] if ports else None))
    return found


def egress_cases(policy: dict) -> list[tuple[str, dict, int, str, bool]]:
    """EGRESS_EXPECTED for `policy`: (what, destination, port, protocol, allowed), where a destination is
    {"labels", "namespace"} (a pod) or {"ip"}, the API server's and the storage's read from the policy's ipBlock rules."""
    addresses = _ip_rules(policy)
    cases = []
    for what, destination, port, protocol, allowed in EGRESS_EXPECTED:
        if isinstance(destination, tuple):
            cases.append((what, {"labels": destination[0], "namespace": destination[1]}, port or 0, protocol, allowed))
        elif destination == "storage" and destination not in addresses:
            continue  # no storage rule: the node mounts the volume, and the pods call no storage endpoint themselves
        elif destination in ("api-server", "storage"):
            address, rule_port = addresses.get(destination, ("", None))  # no rule for it: no address, never reached
            cases.append((what, {"ip": address}, port or rule_port or 0, protocol, allowed))
        else:
            cases.append((what, {"ip": destination}, port or 0, protocol, allowed))
    return cases


def _reaches(policy: dict, destination: dict, port: int, protocol: str) -> bool:
    if "labels" in destination:
        return egress_admits(policy, port, protocol, labels=destination["labels"], namespace=destination["namespace"])
    return bool(destination["ip"]) and egress_admits(policy, port, protocol, ip=destination["ip"])


def _where(destination: dict) -> str:
    if "labels" in destination:
        labels = ",".join(f"{key}={value}" for key, value in destination["labels"].items())
        return f"pods {labels} in {destination['namespace']}"
    return destination["ip"] or "(no rule for it)"


def print_egress(policy: dict) -> None:
    """Where the pods the policy selects may open connections, for each destination of EGRESS_EXPECTED."""
    print(f"{'to':<35} {'address':<55} {'port':>9}  allowed")
    for what, destination, port, protocol, _ in egress_cases(policy):
        reaches = "yes" if _reaches(policy, destination, port, protocol) else "no"
        print(f"{what:<35} {_where(destination):<55} {f'{port}/{protocol}':>9}  {reaches}")


def egress_policy_errors(policy: dict) -> list[str]:
    """The egress policy selects every Ray pod of the course and no data Job pod, and allows exactly EGRESS_EXPECTED."""
    errors = _selection_errors(policy)
    job_labels = load_manifest("data-job.yaml")["spec"]["template"]["metadata"].get("labels", {})
    if selects(policy["spec"]["podSelector"], job_labels):
        errors.append("spec.podSelector: selects the data Job's pod, whose download it would block")
    for what, destination, port, protocol, should in egress_cases(policy):
        if _reaches(policy, destination, port, protocol) != should:
            errors.append(f"spec.egress: the pods {'cannot' if should else 'can'} reach {what} ({_where(destination)}, "
                          f"{port}/{protocol}){'' if should else ', and they should not'}")
    return errors


#: The documentation address ranges (RFC 5737) the repository's egress policy holds until you set your own.
PLACEHOLDER_NETWORKS = [ipaddress.IPv4Network(block) for block in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")]


def _is_placeholder(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    return isinstance(network, ipaddress.IPv4Network) and any(network.subnet_of(block) for block in PLACEHOLDER_NETWORKS)


def placeholder_errors(policy: dict) -> list[str]:
    """The ipBlock rules of a manifest's `spec.egress` (a NetworkPolicy's; other kinds have none) that still hold a
    documentation address: on a real cluster they match nothing, so the autoscaler cannot reach the API server (and
    the pods their storage)."""
    errors = []
    for index, rule in enumerate(policy["spec"].get("egress") or []):
        for peer in rule.get("to") or []:
            cidr = peer.get("ipBlock", {}).get("cidr")
            if cidr and _is_placeholder(ipaddress.ip_network(cidr)):
                errors.append(f"spec.egress.{index}: {cidr} is a placeholder; set the address (section 09) or delete "
                              "the rule")
    return errors
