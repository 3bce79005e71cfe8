"""The course's cross-checks, what a schema cannot see: the image is the course's Ray and Python, the storage every
pod mounts is where the training writes, token auth, resources, and a RayJob runs a course script with flags it takes."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath

import yaml

from helpers.config import CLUSTER_STORAGE, REPO_ROOT, load_config
from helpers.tooling.kuberay.network import egress_policy_errors, networkpolicy_errors
from helpers.tooling.kuberay.reference import DEPLOY_DIR, ManifestError, load_manifest
from helpers.tooling.kuberay.security import security_errors

#: Where the Ray pods find the course's datasets (COURSE_DATA_DIR): on the shared volume, filled by data-job.yaml.
DATA_DIR = CLUSTER_STORAGE / "data"
#: The data Job's command: fill the data folder once (helpers.data.fill_mnist).
FILL_COMMAND = ["python", "-c", "from helpers.data import fill_mnist; fill_mnist()"]


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


#: The Dockerfile's build argument that pins Ray's base image by digest: it has no default, the builder gives it.
DIGEST_ARG = "RAY_IMAGE_DIGEST"


def dockerfile_errors(text: str | None = None) -> list[str]:
    """The Dockerfile builds on Ray's image at the course's pins, by digest, and installs the training's packages only."""
    text = (DEPLOY_DIR / "Dockerfile").read_text() if text is None else text
    errors = []
    found = re.search(r"^FROM\s+(\S+)", text, re.M)
    base = found.group(1) if found else "(no FROM line)"
    expected = f"rayproject/ray:{course_image_tag()}@${{{DIGEST_ARG}}}"
    if base != expected:
        errors.append(f"Dockerfile: FROM {base}, expected {expected} (the course's pins, the base image by digest)")
    arg = re.search(rf"^ARG\s+{DIGEST_ARG}(?:=(\S*))?\s*$", text[:found.start() if found else len(text)], re.M)
    if arg is None:
        errors.append(f"Dockerfile: no `ARG {DIGEST_ARG}` before FROM: the build needs the base image's digest")
    elif arg.group(1) is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", arg.group(1)):
        errors.append(f"Dockerfile: ARG {DIGEST_ARG}={arg.group(1)} is not a digest (sha256:<64 hex digits>)")
    try:
        extras = _image_extras(text)
    except ManifestError as error:
        errors.append(str(error))
    else:
        if extras:
            errors.append(f"Dockerfile: installs the extras {sorted(extras)}: the image takes the training's packages "
                          "only (pyproject.toml's [project] dependencies)")
    return errors


def _image_extras(text: str) -> set[str]:
    found = re.search(r"pip install (?:--\S+ )*-e \"?\.(?:\[([^\]]*)\])?\"?(?:\s|$)", text)
    if found is None:
        raise ManifestError("Dockerfile: does not install the course's pinned packages (pip install --no-cache-dir -e .)")
    return {extra.strip() for extra in (found.group(1) or "").split(",") if extra.strip()}


def image_requirements(text: str | None = None) -> list[str]:
    """The requirements the Dockerfile's `pip install` installs: pyproject.toml's dependencies and the extras it names."""
    text = (DEPLOY_DIR / "Dockerfile").read_text() if text is None else text
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return list(project["dependencies"]) + [req for extra in sorted(_image_extras(text)) for req in extras[extra]]


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
    """The course's cross-checks of a manifest (RayCluster, RayJob, Job, PersistentVolumeClaim, NetworkPolicy): what a
    schema cannot see, and the Pod Security Standard "restricted" for every pod it makes."""
    kind = manifest["kind"]
    if kind == "RayJob":
        errors = cluster_errors(manifest["spec"]["rayClusterSpec"], "spec.rayClusterSpec.") + rayjob_errors(manifest)
        return errors + security_errors(manifest)
    if kind == "RayCluster":
        return cluster_errors(manifest["spec"], "spec.") + security_errors(manifest)
    if kind == "Job":
        return data_job_errors(manifest) + security_errors(manifest)
    if kind == "PersistentVolumeClaim" and "ReadWriteMany" not in manifest["spec"]["accessModes"]:
        return ["spec.accessModes: pods on every node read and write this volume (the data, the runs): it needs "
                "ReadWriteMany"]
    if kind == "NetworkPolicy":
        spec = manifest["spec"]
        return egress_policy_errors(manifest) if "egress" in spec and "ingress" not in spec else networkpolicy_errors(
            manifest)
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


def is_course_image(image: str) -> bool:
    """The course's image, under any registry: ray-course:<Ray>-py<Python>, or that tag with a build suffix
    (ray-course:2.60.0-py311-20261128), so that each build gets a tag of its own."""
    repository, _, tag = image.rpartition(":")
    return repository.rpartition("/")[2] == "ray-course" and (tag == course_image_tag()
                                                               or tag.startswith(course_image_tag() + "-"))


def _pod_errors(pod: dict, token_by_env: bool) -> list[str]:
    errors = []
    ray = pod["containers"][0]  # KubeRay's Ray container is the first one
    if not is_course_image(ray["image"]):
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
    errors = storage_path_errors(env.get("COURSE_STORAGE_PATH"), "env.COURSE_STORAGE_PATH")
    return errors + data_env_errors(env, download=False)


def data_env_errors(env: dict[str, str | None], download: bool) -> list[str]:
    """COURSE_DATA_DIR is the data folder on the shared volume; COURSE_DATA_DOWNLOAD allows a download or not."""
    errors = []
    if env.get("COURSE_DATA_DIR") != str(DATA_DIR):
        errors.append(f"env.COURSE_DATA_DIR: {env.get('COURSE_DATA_DIR')!r}, expected {str(DATA_DIR)!r}, the folder "
                      "on the shared volume the data Job fills (unset, each pod would look in its own image)")
    try:
        allowed = load_config({"COURSE_DATA_DOWNLOAD": env.get("COURSE_DATA_DOWNLOAD") or ""}).data_download
    except ValueError as error:
        return [*errors, f"env.COURSE_DATA_DOWNLOAD: {error}"]
    if allowed != download:
        errors.append("env.COURSE_DATA_DOWNLOAD: set it to '0': a Ray pod never downloads at training time"
                      if not download else "env.COURSE_DATA_DOWNLOAD: set it to '1': this Job is what downloads")
    return errors


def data_job_errors(job: dict) -> list[str]:
    """The data Job fills the Ray pods' data folder, on the shared volume, with the course's image, and ends."""
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    errors = []
    if not is_course_image(container["image"]):
        errors.append(f"image: {container['image']!r}, expected the course's image ray-course:{course_image_tag()}")
    if container.get("command") != FILL_COMMAND:
        errors.append(f"spec.template.spec.containers[0].command: expected {FILL_COMMAND}")
    if pod.get("securityContext", {}).get("fsGroup") != 100:
        errors.append("spec.template.spec.securityContext.fsGroup: set it to 100 (the image's `users` group) to write "
                      "the shared volume")
    claim = storage_claim()
    volumes = [v["name"] for v in pod.get("volumes", []) if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
    if [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in volumes] != [str(CLUSTER_STORAGE)]:
        errors.append(f"volumeMounts: mount the claim {claim!r} at {CLUSTER_STORAGE}")
    errors += data_env_errors({e["name"]: e.get("value") for e in container.get("env", [])}, download=True)
    for field in ("activeDeadlineSeconds", "backoffLimit"):
        if field not in spec:
            errors.append(f"spec.{field}: set it, so that a download that hangs or fails ends")
    return errors


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
    head_image = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    for container in (spec.get("submitterPodTemplate") or {}).get("spec", {}).get("containers", [])[:1]:
        if container.get("image") != head_image:
            errors.append(f"spec.submitterPodTemplate: image {container.get('image')!r}, expected the head's "
                          f"{head_image!r} (`ray job submit` from the same Ray)")
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

