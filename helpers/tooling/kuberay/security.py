"""The Kubernetes Pod Security Standards, "baseline" and "restricted", applied offline to every pod the course's files
make, with the containers KubeRay adds to them.

The rules are those of Kubernetes' own Pod Security admission (the `k8s.io/pod-security-admission` module,
`policy/check_*.go`) at the version the course checks against (KUBERNETES_VERSION), one function each, named by the
admission's check IDs. Two choices make this check stricter than the admission, never looser: it does not relax
runAsNonRoot and runAsUser for pods in a user namespace (`hostUsers: false`, relaxed from 1.35), and it applies the
1.34 check of probes' and lifecycle handlers' `host` field.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

#: (check ID, level, what it requires): the standard, written out. Every container is checked: containers,
#: initContainers and ephemeralContainers.
CHECKS = [
    ("hostProcess", "baseline", "no Windows HostProcess pod or container (windowsOptions.hostProcess)"),
    ("hostNamespaces", "baseline", "no hostNetwork, hostPID or hostIPC"),
    ("privileged", "baseline", "no privileged container"),
    ("capabilities_baseline", "baseline", "capabilities.add only from the container runtime's default set"),
    ("hostPathVolumes", "baseline", "no hostPath volume"),
    ("hostPorts", "baseline", "no hostPort"),
    ("appArmorProfile", "baseline", "AppArmor profile, if set, RuntimeDefault or Localhost (field or annotation)"),
    ("seLinuxOptions", "baseline", "SELinux type only container_t, container_init_t, container_kvm_t or "
                                   "container_engine_t; no SELinux user or role"),
    ("procMount", "baseline", "procMount, if set, Default"),
    ("seccompProfile_baseline", "baseline", "seccomp profile, if set, RuntimeDefault or Localhost (never Unconfined)"),
    ("sysctls", "baseline", "only the safe, namespaced sysctls"),
    ("hostProbesAndhostLifecycle", "baseline", "no `host` in probes and lifecycle handlers (from Kubernetes 1.34)"),
    ("restrictedVolumes", "restricted", "volumes only of the types configMap, csi, downwardAPI, emptyDir, ephemeral, "
                                        "image, persistentVolumeClaim, projected, secret"),
    ("allowPrivilegeEscalation", "restricted", "allowPrivilegeEscalation: false in every container"),
    ("runAsNonRoot", "restricted", "runAsNonRoot: true for the pod (and no container false), or in every container"),
    ("runAsUser", "restricted", "runAsUser never 0"),
    ("seccompProfile_restricted", "restricted", "seccomp profile RuntimeDefault or Localhost for the pod, or in every "
                                                "container"),
    ("capabilities_restricted", "restricted", "capabilities.drop includes ALL in every container; add only "
                                              "NET_BIND_SERVICE"),
]

_DEFAULT_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                         "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
                 "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim",
                       "projected", "secret"}
_SECCOMP_OK = {"RuntimeDefault", "Localhost"}
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _containers(spec: dict) -> Iterator[tuple[str, dict]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            yield f"{kind}[{container.get('name', '?')}]", container


def _context(container: dict) -> dict:
    return container.get("securityContext") or {}


def _host_process(meta: dict, spec: dict) -> Iterator[str]:
    if (spec.get("securityContext") or {}).get("windowsOptions", {}).get("hostProcess"):
        yield "securityContext.windowsOptions.hostProcess: must be unset or false"
    for where, container in _containers(spec):
        if _context(container).get("windowsOptions", {}).get("hostProcess"):
            yield f"{where}.securityContext.windowsOptions.hostProcess: must be unset or false"


def _host_namespaces(meta: dict, spec: dict) -> Iterator[str]:
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"{field}: must be unset or false"


def _privileged(meta: dict, spec: dict) -> Iterator[str]:
    for where, container in _containers(spec):
        if _context(container).get("privileged"):
            yield f"{where}.securityContext.privileged: must be unset or false"


def _capabilities_baseline(meta: dict, spec: dict) -> Iterator[str]:
    for where, container in _containers(spec):
        added = set((_context(container).get("capabilities") or {}).get("add") or []) - _DEFAULT_CAPABILITIES
        if added:
            yield f"{where}.securityContext.capabilities.add: {sorted(added)} are not in the default set"


def _host_path_volumes(meta: dict, spec: dict) -> Iterator[str]:
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            yield f"volumes[{volume.get('name')}].hostPath: no hostPath volumes"


def _host_ports(meta: dict, spec: dict) -> Iterator[str]:
    for where, container in _containers(spec):
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                yield f"{where}.ports.hostPort: {port['hostPort']}, must be unset or 0"


def _app_armor(meta: dict, spec: dict) -> Iterator[str]:
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(_APPARMOR_ANNOTATION) and value not in ("", "runtime/default") and not str(
                value).startswith("localhost/"):
            yield f"metadata.annotations[{key}]: {value!r}, must be runtime/default or localhost/*"
    contexts = [("securityContext", spec.get("securityContext") or {})]
    contexts += [(f"{where}.securityContext", _context(c)) for where, c in _containers(spec)]
    for where, context in contexts:
        kind = (context.get("appArmorProfile") or {}).get("type")
        if kind is not None and kind not in ("RuntimeDefault", "Localhost"):
            yield f"{where}.appArmorProfile.type: {kind!r}, must be RuntimeDefault or Localhost"


def _se_linux(meta: dict, spec: dict) -> Iterator[str]:
    contexts = [("securityContext", spec.get("securityContext") or {})]
    contexts += [(f"{where}.securityContext", _context(c)) for where, c in _containers(spec)]
    for where, context in contexts:
        options = context.get("seLinuxOptions") or {}
        if options.get("type", "") not in _SELINUX_TYPES:
            yield f"{where}.seLinuxOptions.type: {options['type']!r} is not allowed"
        for field in ("user", "role"):
            if options.get(field):
                yield f"{where}.seLinuxOptions.{field}: must be unset"


def _proc_mount(meta: dict, spec: dict) -> Iterator[str]:
    for where, container in _containers(spec):
        if _context(container).get("procMount", "Default") != "Default":
            yield f"{where}.securityContext.procMount: must be unset or Default"


def _seccomp_baseline(meta: dict, spec: dict) -> Iterator[str]:
    contexts = [("securityContext", spec.get("securityContext") or {})]
    contexts += [(f"{where}.securityContext", _context(c)) for where, c in _containers(spec)]
    for where, context in contexts:
        kind = (context.get("seccompProfile") or {}).get("type")
        if kind is not None and kind not in _SECCOMP_OK:
            yield f"{where}.seccompProfile.type: {kind!r}, must be RuntimeDefault or Localhost"


def _sysctls(meta: dict, spec: dict) -> Iterator[str]:
    for sysctl in (spec.get("securityContext") or {}).get("sysctls") or []:
        if sysctl.get("name") not in _SAFE_SYSCTLS:
            yield f"securityContext.sysctls: {sysctl.get('name')!r} is not one of the safe sysctls"


def _host_probes(meta: dict, spec: dict) -> Iterator[str]:
    for where, container in _containers(spec):
        handlers = [(probe, container.get(probe) or {}) for probe in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [(f"lifecycle.{hook}", (container.get("lifecycle") or {}).get(hook) or {})
                     for hook in ("postStart", "preStop")]
        for name, handler in handlers:
            for kind in ("httpGet", "tcpSocket"):
                if (handler.get(kind) or {}).get("host"):
                    yield f"{where}.{name}.{kind}.host: must be unset"


def _restricted_volumes(meta: dict, spec: dict) -> Iterator[str]:
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            yield f"volumes[{volume.get('name')}]: {sorted(kinds - _RESTRICTED_VOLUMES)} is not an allowed volume type"


def _allow_privilege_escalation(meta: dict, spec: dict) -> Iterator[str]:
    for where, container in _containers(spec):
        if _context(container).get("allowPrivilegeEscalation") is not False:
            yield f"{where}.securityContext.allowPrivilegeEscalation: must be false"


def _run_as_non_root(meta: dict, spec: dict) -> Iterator[str]:
    pod = (spec.get("securityContext") or {}).get("runAsNonRoot")
    if pod is False:
        yield "securityContext.runAsNonRoot: must be true"
    for where, container in _containers(spec):
        value = _context(container).get("runAsNonRoot")
        if value is False or (value is None and pod is not True):
            yield f"{where}.securityContext.runAsNonRoot: must be true (here or for the pod)"


def _run_as_user(meta: dict, spec: dict) -> Iterator[str]:
    if (spec.get("securityContext") or {}).get("runAsUser") == 0:
        yield "securityContext.runAsUser: must not be 0"
    for where, container in _containers(spec):
        if _context(container).get("runAsUser") == 0:
            yield f"{where}.securityContext.runAsUser: must not be 0"


def _seccomp_restricted(meta: dict, spec: dict) -> Iterator[str]:
    pod = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    for where, container in _containers(spec):
        kind = (_context(container).get("seccompProfile") or {}).get("type")
        if (kind or pod) not in _SECCOMP_OK:
            yield f"{where}.securityContext.seccompProfile.type: set RuntimeDefault or Localhost (here or for the pod)"


def _capabilities_restricted(meta: dict, spec: dict) -> Iterator[str]:
    for where, container in _containers(spec):
        capabilities = _context(container).get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield f"{where}.securityContext.capabilities.drop: must include ALL"
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            yield f"{where}.securityContext.capabilities.add: {sorted(added)}, only NET_BIND_SERVICE is allowed"


_FUNCTIONS: dict[str, Callable[[dict, dict], Iterator[str]]] = {
    "hostProcess": _host_process, "hostNamespaces": _host_namespaces, "privileged": _privileged,
    "capabilities_baseline": _capabilities_baseline, "hostPathVolumes": _host_path_volumes, "hostPorts": _host_ports,
    "appArmorProfile": _app_armor, "seLinuxOptions": _se_linux, "procMount": _proc_mount,
    "seccompProfile_baseline": _seccomp_baseline, "sysctls": _sysctls, "hostProbesAndhostLifecycle": _host_probes,
    "restrictedVolumes": _restricted_volumes, "allowPrivilegeEscalation": _allow_privilege_escalation,
    "runAsNonRoot": _run_as_non_root, "runAsUser": _run_as_user, "seccompProfile_restricted": _seccomp_restricted,
    "capabilities_restricted": _capabilities_restricted,
}


#: The Role KubeRay v1.7.0 binds to the head pod's ServiceAccount when in-tree autoscaling is on, in the cluster's
#: namespace, for every object of each kind (ray-operator/controllers/ray/common/rbac.go, BuildRole): (API group,
#: resource, verbs).
HEAD_ROLE = [
    ("", "pods", ("get", "list", "watch", "patch")),
    ("", "pods/resize", ("patch",)),
    ("ray.io", "rayclusters", ("get", "patch")),
]


def print_head_role() -> None:
    """What the head pod's ServiceAccount may do in its namespace (HEAD_ROLE), one line per resource."""
    print(f"{'resource':<22} {'verbs':<24} on")
    for group, resource, verbs in HEAD_ROLE:
        name = f"{resource} ({group})" if group else resource
        print(f"{name:<22} {', '.join(verbs):<24} every one in the namespace")


def pod_security_errors(template: dict, level: str = "restricted") -> list[str]:
    """Every way a pod template ({metadata, spec}) breaks the Pod Security Standard `level` (baseline, restricted)."""
    levels = {"baseline": {"baseline"}, "restricted": {"baseline", "restricted"}}[level]
    meta, spec = template.get("metadata") or {}, template.get("spec") or {}
    return [f"{error} ({check})" for check, check_level, _ in CHECKS if check_level in levels
            for error in _FUNCTIONS[check](meta, spec)]


def operator_pods(manifest: dict) -> dict[str, dict]:
    """The pod templates a manifest makes, named, with what KubeRay v1.7.0 adds to them (ray-operator/controllers/ray/).

    RayCluster (and a RayJob's cluster): the head, with the `autoscaler` container when in-tree autoscaling is on
    (its securityContext from autoscalerOptions.securityContext; common/pod.go, BuildAutoscalerContainer and
    mergeAutoscalerOverrides), and each worker group, with the init container `wait-gcs-ready`, which copies the Ray
    container's securityContext (DefaultWorkerPodTemplate). RayJob: its submitter, spec.submitterPodTemplate or
    KubeRay's default (common/job.go, GetSubmitterTemplate: a container without securityContext). Job: its template.
    """
    kind = manifest.get("kind")
    if kind == "Job":
        return {"job": copy.deepcopy(manifest["spec"]["template"])}
    if kind == "RayJob":
        spec = manifest["spec"]
        pods = operator_pods({"kind": "RayCluster", "spec": spec["rayClusterSpec"]}) if "rayClusterSpec" in spec else {}
        default = {"spec": {"restartPolicy": "Never", "containers": [{"name": "ray-job-submitter"}]}}
        if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
            pods["submitter"] = copy.deepcopy(spec.get("submitterPodTemplate") or default)
        return pods
    if kind != "RayCluster":
        return {}
    spec = manifest["spec"]
    head = copy.deepcopy(spec["headGroupSpec"]["template"])
    if spec.get("enableInTreeAutoscaling"):
        autoscaler = {"name": "autoscaler"}
        if (context := (spec.get("autoscalerOptions") or {}).get("securityContext")) is not None:
            autoscaler["securityContext"] = copy.deepcopy(context)
        head["spec"]["containers"].append(autoscaler)
    pods = {"head": head}
    for group in spec.get("workerGroupSpecs") or []:
        worker = copy.deepcopy(group["template"])
        ray = worker["spec"]["containers"][0]
        wait = {"name": "wait-gcs-ready", **({"securityContext": ray["securityContext"]} if "securityContext" in ray
                                             else {})}
        worker["spec"].setdefault("initContainers", []).append(copy.deepcopy(wait))
        pods[group["groupName"]] = worker
    return pods


def security_errors(manifest: dict) -> list[str]:
    """The Pod Security Standard "restricted", applied to every pod `manifest` makes (its KubeRay-added parts too)."""
    return [f"pod {name}: {error}" for name, template in operator_pods(manifest).items()
            for error in pod_security_errors(template)]
