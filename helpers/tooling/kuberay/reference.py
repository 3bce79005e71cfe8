"""KubeRay's reference files (its CRDs and the ray-cluster chart, downloaded when missing) and the course's own
manifests in deploy/kuberay/."""

from __future__ import annotations

import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from helpers.config import REPO_ROOT, load_config, load_dotenv_file

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
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ManifestError(ValueError):
    """A manifest breaks its schema or one of the course's cross-checks; the message lists every problem."""


class KubeRayReferenceError(FileNotFoundError):
    """KubeRay's CRDs or chart are neither on this machine nor downloadable."""


def reference_dir() -> Path:
    """The folder with KubeRay's CRDs and the ray-cluster chart (COURSE_KUBERAY_DIR), downloaded if missing.

    Default: <data dir>/kuberay-v1.7.0. Offline machines point COURSE_KUBERAY_DIR at a copy (CI: ../shared/kuberay);
    read by `load_config` (CourseConfig.kuberay_dir), a relative path from the repository root as COURSE_DATA_DIR.
    """
    load_dotenv_file()
    cfg = load_config()
    folder = cfg.kuberay_dir or cfg.data_dir / f"kuberay-v{KUBERAY_VERSION}"
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
    """The default values of the KubeRay's `ray-cluster` Helm chart v1.7.0."""
    return _load_yaml(reference_dir() / CHART_DIR / "values.yaml")


def load_manifest(name: str) -> dict:
    """A manifest of deploy/kuberay/ as a dict (one YAML document per file)."""
    return _load_yaml(DEPLOY_DIR / name)


