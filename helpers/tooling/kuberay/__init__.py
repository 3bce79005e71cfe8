"""Lesson 08: the course's KubeRay files (deploy/kuberay/), checked offline against KubeRay's own schemas.

No Kubernetes cluster is needed: RayCluster and RayJob manifests are validated against the
`openAPIV3Schema` of KubeRay's CRDs, the PersistentVolumeClaim, Job, NetworkPolicies and Secret against Kubernetes'
own schemas (the `kubernetes-validate` package), and the Helm values key by key against the chart's default
values, then rendered by the real `helm template` with the real chart. Then the cross-checks a schema cannot
make: the storage every pod mounts is where the training writes and reads its data, no Ray pod downloads, the image
is the course's Ray and Python with the training's packages only, the RayJob runs a script that exists with flags it
takes, every pod passes the Pod Security Standard "restricted", the NetworkPolicies admit the Jobs API only from the
pods they name and let the Ray pods out only to DNS, each other, the API server and the storage.

One module per job; every name stays importable from here (`from helpers.tooling import kuberay; kuberay.validate`):
`reference` (KubeRay's CRDs and chart, the course's manifests), `schemas` (validation against the schemas, the Helm
values key by key), `helm` (the pinned helm: install, find, `helm template`), `course` (the cross-checks), `security`
(the Pod Security Standards, the pods KubeRay makes, the head's Role), `network` (the NetworkPolicies' reach, in and
out), `commands` (what lesson 08 prints, and its commands on a cluster). `python -m helpers.tooling.kuberay
--install-helm` (`make install`) installs the pinned helm.
"""

from __future__ import annotations

from helpers.tooling.kuberay.commands import (
    check_deploy_folder,
    example_pods,
    kubernetes_enabled,
    on_cluster,
    print_groups,
)
from helpers.tooling.kuberay.course import (
    DATA_DIR,
    DIGEST_ARG,
    FILL_COMMAND,
    auth_secret,
    cluster_errors,
    course_errors,
    course_image_tag,
    course_pins,
    data_env_errors,
    data_job_errors,
    dockerfile_errors,
    entrypoint_errors,
    image_requirements,
    image_workdir,
    rayjob_errors,
    storage_claim,
    storage_path_errors,
)
from helpers.tooling.kuberay.helm import (
    HelmNotFoundError,
    helm_binary,
    helm_found,
    helm_pin,
    helm_template,
    install_helm,
)
from helpers.tooling.kuberay.network import (
    DASHBOARD_PORT,
    EGRESS_EXPECTED,
    GCS_PORT,
    REACH_EXPECTED,
    admits,
    egress_admits,
    egress_cases,
    egress_policy_errors,
    networkpolicy_errors,
    placeholder_errors,
    print_egress,
    print_reach,
    reach_cases,
    selects,
)
from helpers.tooling.kuberay.reference import (
    CHART_DIR,
    CRD_FILES,
    DEPLOY_DIR,
    KUBERAY_VERSION,
    KUBERNETES_VERSION,
    REFERENCE_FILES,
    RELEASE_URL,
    KubeRayReferenceError,
    ManifestError,
    chart_defaults,
    crd_schema,
    download_reference,
    load_manifest,
    reference_dir,
)
from helpers.tooling.kuberay.schemas import (
    CHART_COMMENTED_KEYS,
    CHART_PASS_THROUGH,
    chart_key_errors,
    schema_errors,
    validate,
)
from helpers.tooling.kuberay.security import (
    CHECKS,
    HEAD_ROLE,
    operator_pods,
    pod_security_errors,
    print_head_role,
    security_errors,
)

__all__ = [
    "CHART_COMMENTED_KEYS",
    "CHART_DIR",
    "CHART_PASS_THROUGH",
    "CHECKS",
    "CRD_FILES",
    "DASHBOARD_PORT",
    "DATA_DIR",
    "DEPLOY_DIR",
    "DIGEST_ARG",
    "EGRESS_EXPECTED",
    "FILL_COMMAND",
    "GCS_PORT",
    "HEAD_ROLE",
    "HelmNotFoundError",
    "KUBERAY_VERSION",
    "KUBERNETES_VERSION",
    "KubeRayReferenceError",
    "ManifestError",
    "REACH_EXPECTED",
    "REFERENCE_FILES",
    "RELEASE_URL",
    "admits",
    "auth_secret",
    "chart_defaults",
    "chart_key_errors",
    "check_deploy_folder",
    "cluster_errors",
    "course_errors",
    "course_image_tag",
    "course_pins",
    "crd_schema",
    "data_env_errors",
    "data_job_errors",
    "dockerfile_errors",
    "download_reference",
    "egress_admits",
    "egress_cases",
    "egress_policy_errors",
    "entrypoint_errors",
    "example_pods",
    "helm_binary",
    "helm_found",
    "helm_pin",
    "helm_template",
    "image_requirements",
    "image_workdir",
    "install_helm",
    "kubernetes_enabled",
    "load_manifest",
    "networkpolicy_errors",
    "on_cluster",
    "operator_pods",
    "placeholder_errors",
    "pod_security_errors",
    "print_egress",
    "print_groups",
    "print_head_role",
    "print_reach",
    "rayjob_errors",
    "reach_cases",
    "reference_dir",
    "schema_errors",
    "security_errors",
    "selects",
    "storage_claim",
    "storage_path_errors",
    "validate",
]
