"""What lesson 08 prints (node groups, the deploy folder's checks, pods in trouble) and the commands it runs on a
Kubernetes cluster when one is set up (COURSE_KUBERNETES=1)."""

from __future__ import annotations

import subprocess
from typing import Any

from helpers.config import REPO_ROOT, load_config, load_dotenv_file
from helpers.tooling.kuberay.course import course_image_tag, dockerfile_errors, image_requirements
from helpers.tooling.kuberay.helm import helm_template
from helpers.tooling.kuberay.network import placeholder_errors
from helpers.tooling.kuberay.reference import DEPLOY_DIR, ManifestError, load_manifest
from helpers.tooling.kuberay.schemas import chart_key_errors, validate


def example_pods() -> dict[str, dict]:
    """Pods as `kubectl get pod NAME -o json` shows them, one per row of lesson 08's troubleshooting table.

    Only the fields that tell the story are filled in (Kubernetes' Pod API: status.phase, status.conditions,
    status.containerStatuses); the messages are Kubernetes' own formats (scheduler, kubelet, volume binding).
    """
    def pod(phase: str, conditions: list | None = None, **container: Any) -> dict:
        statuses = [{"name": "ray-worker", "restartCount": 0, "ready": phase == "Running", **container}]
        return {"kind": "Pod", "metadata": {"name": "ray-course-cpu-worker-x7k2p"},
                "status": {"phase": phase, "conditions": conditions or [],
                           "containerStatuses": statuses if container else []}}

    def unschedulable(message: str) -> list:
        return [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]

    return {
        "healthy": pod("Running", state={"running": {}}),
        "image": pod("Pending", state={"waiting": {"reason": "ImagePullBackOff",
                                                   "message": 'Back-off pulling image "ray-course:2.60.0-py311"'}}),
        "memory": pod("Running", state={"running": {}}, restartCount=2,
                      lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}}),
        "secret": pod("Pending", state={"waiting": {"reason": "CreateContainerConfigError",
                                                    "message": 'secret "ray-course-auth" not found'}}),
        "gpu": pod("Pending", unschedulable(
            "0/3 nodes are available: 1 node(s) had untolerated taint {node-role.kubernetes.io/control-plane: }, "
            "2 Insufficient nvidia.com/gpu.")),
        "volume": pod("Pending", unschedulable(
            "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims.")),
    }


def print_groups(spec: dict) -> None:
    """One line per node group of a RayCluster spec: pods (min-max), resources per pod and image."""
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    print(f"{'group':<6} {'pods':<8} {'CPU':>4} {'memory':>7} {'GPU':>4}  {'Ray CPUs':<9} image")
    for name, group in groups:
        container = group["template"]["spec"]["containers"][0]
        limits = container["resources"]["limits"]
        pods = "1" if name == "head" else f"{group['replicas']} ({group['minReplicas']}-{group['maxReplicas']})"
        ray_cpus = group.get("rayStartParams", {}).get("num-cpus", limits["cpu"])
        print(f"{name:<6} {pods:<8} {limits['cpu']:>4} {limits['memory']:>7} {limits.get('nvidia.com/gpu', '-'):>4}"
              f"  {ray_cpus:<9} {container['image']}")


#: The manifests of deploy/kuberay/, in the order lesson 08 applies them.
MANIFESTS = ("storage-pvc.yaml", "data-job.yaml", "networkpolicy.yaml", "networkpolicy-egress.yaml", "raycluster.yaml",
             "rayjob.yaml")


def check_deploy_folder() -> None:
    """Check every file of deploy/kuberay/ and print one line each; raise ManifestError at the first problem."""
    for problem in dockerfile_errors():
        raise ManifestError(problem)
    print(f"{'Dockerfile':<25} FROM rayproject/ray:{course_image_tag()} by digest, the training's "
          f"{len(image_requirements())} pinned packages")
    for name in MANIFESTS:
        print(f"{name:<25} {validate(load_manifest(name))}: schema and cross-checks pass")
    values = load_manifest("values.yaml")
    if errors := chart_key_errors(values):
        raise ManifestError("values.yaml:\n  " + "\n  ".join(errors))
    rendered = ", ".join(validate(manifest) for manifest in helm_template(DEPLOY_DIR / "values.yaml"))
    print(f"{'values.yaml':<25} every key is the chart's; `helm template` renders {rendered}, which passes")


def kubernetes_enabled() -> bool:
    """Whether lesson 08 runs its cluster commands: COURSE_KUBERNETES=1, against kubectl's current context."""
    load_dotenv_file()
    return load_config().kubernetes


def on_cluster(command: str, timeout: float = 900) -> None:
    """Run a shell command that needs a Kubernetes cluster with KubeRay, or print it as skipped when none is set up.

    COURSE_KUBERNETES=1 (in .env) runs the lesson's commands against kubectl's current context.
    """
    if not kubernetes_enabled():
        print(f"[needs a Kubernetes cluster: skipped] $ {command}")
        return
    for name in MANIFESTS if "apply" in command else ():  # what passes offline but would fail on the cluster:
        if name in command and (errors := placeholder_errors(load_manifest(name))):  # addresses left at placeholders
            raise ManifestError(f"{name}:\n  " + "\n  ".join(errors))
    print(f"$ {command}", flush=True)
    subprocess.run(command, shell=True, check=True, timeout=timeout, cwd=REPO_ROOT)

