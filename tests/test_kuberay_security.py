"""Lesson 08's pods against the Kubernetes Pod Security Standard "restricted" (helpers.tooling.kuberay.security):
every pod every file of deploy/kuberay/ makes passes, the containers KubeRay adds included, and each rule of the
standard, broken on purpose, fails with its check's name."""

from __future__ import annotations

import copy

import pytest

from helpers.tooling import kuberay

FILES = ["raycluster.yaml", "rayjob.yaml", "data-job.yaml"]


@pytest.fixture(scope="module")
def pods() -> dict[str, dict]:
    """Every pod the course's files make, by file and name, KubeRay's additions included; the Helm chart's too."""
    found = {f"{name}:{pod}": template for name in FILES
             for pod, template in kuberay.operator_pods(kuberay.load_manifest(name)).items()}
    (rendered,) = kuberay.helm_template(kuberay.DEPLOY_DIR / "values.yaml")
    found |= {f"helm:{pod}": template for pod, template in kuberay.operator_pods(rendered).items()}
    return found


def test_every_pod_of_every_file_passes_restricted(pods):
    assert sorted(pods) == ["data-job.yaml:job", "helm:cpu", "helm:gpu", "helm:head", "raycluster.yaml:cpu",
                            "raycluster.yaml:gpu", "raycluster.yaml:head", "rayjob.yaml:cpu", "rayjob.yaml:gpu",
                            "rayjob.yaml:head", "rayjob.yaml:submitter"]
    assert {name: kuberay.pod_security_errors(template) for name, template in pods.items()} == dict.fromkeys(pods, [])
    for name in FILES:
        assert kuberay.security_errors(kuberay.load_manifest(name)) == [], name


def test_the_pods_checked_carry_what_kuberay_adds(pods):
    # KubeRay v1.7.0 adds the autoscaler container to the head and the wait-gcs-ready init container to each worker.
    for source in ("raycluster.yaml", "rayjob.yaml", "helm"):
        head = pods[f"{source}:head"]["spec"]
        assert [c["name"] for c in head["containers"]] == ["ray-head", "autoscaler"], source
        assert head["containers"][1]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        for group in ("cpu", "gpu"):
            worker = pods[f"{source}:{group}"]["spec"]
            assert [c["name"] for c in worker["initContainers"]] == ["wait-gcs-ready"]
            assert worker["initContainers"][0]["securityContext"] == worker["containers"][0]["securityContext"]
    # Without a submitterPodTemplate, KubeRay's default submitter has no securityContext: "restricted" refuses it.
    job = kuberay.load_manifest("rayjob.yaml")
    del job["spec"]["submitterPodTemplate"]
    default = kuberay.operator_pods(job)["submitter"]
    assert default["spec"]["containers"] == [{"name": "ray-job-submitter"}]
    errors = kuberay.security_errors(job)
    assert "pod submitter: containers[ray-job-submitter].securityContext.allowPrivilegeEscalation: must be false " \
           "(allowPrivilegeEscalation)" in errors
    with pytest.raises(kuberay.ManifestError, match=r"pod submitter: .*\(runAsNonRoot\)"):
        kuberay.validate(job)


POD = "spec"
RAY = "spec.containers.0"


def _set(template: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = template
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if value is DELETE:
        node.pop(int(last) if last.isdigit() else last)
    elif last.isdigit() and int(last) == len(node):
        node.append(value)
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value


DELETE = object()
#: One broken rule each: (what is set, value, the check that must refuse it, the text its error carries).
VIOLATIONS = [
    (f"{POD}.securityContext.windowsOptions", {"hostProcess": True}, "hostProcess", "windowsOptions.hostProcess"),
    (f"{RAY}.securityContext.windowsOptions", {"hostProcess": True}, "hostProcess", "windowsOptions.hostProcess"),
    (f"{POD}.hostNetwork", True, "hostNamespaces", "hostNetwork: must be unset or false"),
    (f"{POD}.hostPID", True, "hostNamespaces", "hostPID"),
    (f"{POD}.hostIPC", True, "hostNamespaces", "hostIPC"),
    (f"{RAY}.securityContext.privileged", True, "privileged", "privileged: must be unset or false"),
    (f"{RAY}.securityContext.capabilities.add", ["SYS_PTRACE"], "capabilities_baseline", "['SYS_PTRACE'] are not"),
    (f"{POD}.volumes.1", {"name": "host", "hostPath": {"path": "/var/run"}}, "hostPathVolumes", "no hostPath"),
    (f"{RAY}.ports", [{"containerPort": 8265, "hostPort": 8265}], "hostPorts", "hostPort: 8265"),
    ("metadata.annotations", {"container.apparmor.security.beta.kubernetes.io/ray-worker": "unconfined"},
     "appArmorProfile", "must be runtime/default or localhost/*"),
    (f"{RAY}.securityContext.appArmorProfile", {"type": "Unconfined"}, "appArmorProfile", "'Unconfined'"),
    (f"{POD}.securityContext.seLinuxOptions", {"type": "spc_t"}, "seLinuxOptions", "'spc_t' is not allowed"),
    (f"{RAY}.securityContext.seLinuxOptions", {"user": "system_u"}, "seLinuxOptions", "seLinuxOptions.user"),
    (f"{RAY}.securityContext.procMount", "Unmasked", "procMount", "procMount: must be unset or Default"),
    (f"{RAY}.securityContext.seccompProfile", {"type": "Unconfined"}, "seccompProfile_baseline", "'Unconfined'"),
    (f"{POD}.securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "sysctls", "'kernel.msgmax'"),
    (f"{RAY}.livenessProbe", {"httpGet": {"host": "10.0.0.1", "port": 8265}}, "hostProbesAndhostLifecycle",
     "livenessProbe.httpGet.host"),
    (f"{POD}.volumes.1", {"name": "nfs", "nfs": {"server": "10.0.0.2", "path": "/"}}, "restrictedVolumes",
     "['nfs'] is not an allowed volume type"),
    (f"{RAY}.securityContext.allowPrivilegeEscalation", DELETE, "allowPrivilegeEscalation", "must be false"),
    (f"{RAY}.securityContext.allowPrivilegeEscalation", True, "allowPrivilegeEscalation", "must be false"),
    (f"{POD}.securityContext.runAsNonRoot", DELETE, "runAsNonRoot", "must be true (here or for the pod)"),
    (f"{RAY}.securityContext.runAsNonRoot", False, "runAsNonRoot", "must be true"),
    (f"{POD}.securityContext.runAsUser", 0, "runAsUser", "runAsUser: must not be 0"),
    (f"{RAY}.securityContext.runAsUser", 0, "runAsUser", "runAsUser: must not be 0"),
    (f"{POD}.securityContext.seccompProfile", DELETE, "seccompProfile_restricted", "set RuntimeDefault or Localhost"),
    (f"{RAY}.securityContext.capabilities.drop", DELETE, "capabilities_restricted", "must include ALL"),
    (f"{RAY}.securityContext.capabilities.add", ["CHOWN"], "capabilities_restricted", "only NET_BIND_SERVICE"),
]


@pytest.mark.parametrize("path, value, check, expected", VIOLATIONS,
                         ids=[f"{v[2]}:{v[0].split('.')[-1]}" for v in VIOLATIONS])
def test_each_broken_rule_fails_with_its_check(path, value, check, expected):
    template = copy.deepcopy(kuberay.operator_pods(kuberay.load_manifest("raycluster.yaml"))["cpu"])
    assert kuberay.pod_security_errors(template) == []
    _set(template, path, value)
    errors = [e for e in kuberay.pod_security_errors(template) if e.endswith(f"({check})")]
    assert any(expected in error for error in errors), kuberay.pod_security_errors(template)


def test_every_check_of_the_standard_is_shown_to_fail():
    assert sorted({check for _, _, check, _ in VIOLATIONS}) == sorted(check for check, _, _ in kuberay.CHECKS)
    assert {level for _, level, _ in kuberay.CHECKS} == {"baseline", "restricted"}


def test_a_container_kubeRay_adds_is_checked_too():
    cluster = kuberay.load_manifest("raycluster.yaml")
    del cluster["spec"]["autoscalerOptions"]["securityContext"]
    with pytest.raises(kuberay.ManifestError, match=r"pod head: containers\[autoscaler\]\.securityContext\."
                                                    r"allowPrivilegeEscalation: must be false"):
        kuberay.validate(cluster)
    # wait-gcs-ready copies the Ray container's securityContext: a worker without one fails twice.
    del cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["securityContext"]
    errors = kuberay.security_errors(cluster)
    assert "pod cpu: initContainers[wait-gcs-ready].securityContext.capabilities.drop: must include ALL " \
           "(capabilities_restricted)" in errors
    assert "pod cpu: containers[ray-worker].securityContext.capabilities.drop: must include ALL " \
           "(capabilities_restricted)" in errors


def test_a_helm_value_that_breaks_the_standard_fails_once_rendered():
    values = kuberay.load_manifest("values.yaml")
    del values["worker"]["podSecurityContext"]["seccompProfile"]
    (rendered,) = kuberay.helm_template(values)
    with pytest.raises(kuberay.ManifestError, match=r"pod cpu: containers\[ray-worker\]\.securityContext\."
                                                    r"seccompProfile\.type: set RuntimeDefault or Localhost"):
        kuberay.validate(rendered)


def test_py_spy_s_sys_ptrace_is_refused_even_by_baseline():
    # py-spy (lesson 06) needs SYS_PTRACE. Two ways to grant it, both refused where "baseline" or "restricted" is
    # enforced: a worker group that adds it, as KubeRay's sample ray-cluster.py-spy.yaml does, and the ephemeral
    # container `kubectl debug --profile=general` adds (kubectl's pkg/cmd/debug/profiles.go, allowProcessTracing); the
    # Pod Security admission checks ephemeral containers too.
    worker = copy.deepcopy(kuberay.operator_pods(kuberay.load_manifest("raycluster.yaml"))["cpu"])
    worker["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE"]}}
    assert [e.rpartition("(")[2] for e in kuberay.pod_security_errors(worker, level="baseline")] == [
        "capabilities_baseline)"]
    debugged = copy.deepcopy(kuberay.operator_pods(kuberay.load_manifest("raycluster.yaml"))["cpu"])
    debugged["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "ray-course:2.60.0-py311",
                                                "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}]
    baseline = kuberay.pod_security_errors(debugged, level="baseline")
    assert baseline == ["ephemeralContainers[debugger].securityContext.capabilities.add: ['SYS_PTRACE'] are not in "
                        "the default set (capabilities_baseline)"]
    restricted = kuberay.pod_security_errors(debugged)
    assert [error.rpartition("(")[2] for error in restricted] == [
        "capabilities_baseline)", "allowPrivilegeEscalation)", "capabilities_restricted)", "capabilities_restricted)"]
    assert all(error.startswith("ephemeralContainers[debugger]") for error in restricted)
