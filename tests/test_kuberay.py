"""Lesson 08's KubeRay files, checked offline: KubeRay v1.7.0's CRD schemas, Kubernetes' core schemas, the Helm
chart's values rendered by the real `helm template` with the real chart v1.7.0, and the course's cross-checks.
Every check is shown to catch an injected mistake."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.config import CLUSTER_STORAGE, REPO_ROOT, load_config
from helpers.tooling import kuberay
from tests.support import FAILS_FAST_S

MANIFESTS = ["storage-pvc.yaml", "data-job.yaml", "networkpolicy.yaml", "networkpolicy-egress.yaml", "raycluster.yaml",
             "rayjob.yaml"]


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    return {name: kuberay.load_manifest(name) for name in [*MANIFESTS, "values.yaml"]}


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_manifest_passes_its_schema_and_the_cross_checks(manifests, name):
    assert kuberay.schema_errors(manifests[name]) == []
    assert kuberay.course_errors(manifests[name]) == []


def test_the_installed_helm_is_the_pinned_one():
    version = subprocess.run([kuberay.helm_binary(), "version", "--short"], capture_output=True, text=True).stdout
    assert version.startswith(kuberay.helm_pin()["version"] + "+"), version


def test_the_helm_values_are_keys_of_the_chart_and_render_a_valid_ray_cluster(manifests):
    values = manifests["values.yaml"]
    assert kuberay.chart_key_errors(values) == []
    (rendered,) = kuberay.helm_template(kuberay.DEPLOY_DIR / "values.yaml")  # the chart makes one object
    assert kuberay.validate(rendered) == "RayCluster/ray-course-helm"
    assert rendered["metadata"]["labels"]["helm.sh/chart"] == f"ray-cluster-{kuberay.KUBERAY_VERSION}"
    assert [g["groupName"] for g in rendered["spec"]["workerGroupSpecs"]] == ["cpu", "gpu"]  # the chart's example off


def test_a_broken_chart_values_file_fails_with_helm_s_message(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text("head: [unclosed\n")
    with pytest.raises(kuberay.ManifestError, match="helm template failed: .*values.yaml"):
        kuberay.helm_template(path)


def test_without_helm_the_error_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(kuberay.HelmNotFoundError, match="run `make install`"):
        kuberay.helm_binary()


def test_the_helm_cluster_matches_the_manifest_cluster(manifests):
    # Two ways to install one cluster: the same groups, resources, storage, bounds and pod labels.
    (rendered,) = kuberay.helm_template(kuberay.DEPLOY_DIR / "values.yaml")
    rendered = rendered["spec"]
    manifest = manifests["raycluster.yaml"]["spec"]

    def shape(spec):
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        return [(g.get("groupName"), g.get("minReplicas"), g.get("maxReplicas"),
                 g["template"]["spec"]["containers"][0]["resources"], g["template"]["spec"]["securityContext"],
                 g["template"]["spec"].get("tolerations"),
                 g["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"]) for g in groups]

    assert shape(rendered) == shape(manifest)
    assert rendered["rayVersion"] == manifest["rayVersion"] == kuberay.course_pins()["ray"]


def test_the_rayjob_runs_on_the_same_cluster_spec(manifests):
    assert manifests["rayjob.yaml"]["spec"]["rayClusterSpec"] == manifests["raycluster.yaml"]["spec"]


def test_the_chart_keys_the_course_uses_from_comments_are_documented_there():
    text = (kuberay.reference_dir() / kuberay.CHART_DIR / "values.yaml").read_text()
    for keys in kuberay.CHART_COMMENTED_KEYS.values():
        for key in keys:
            assert re.search(rf"^\s*# {key}:", text, re.M), key


def test_the_chart_defaults_are_not_the_course_s_ray():
    # Why the values set the image: the chart's own default is another Ray, without torch.
    assert kuberay.chart_defaults()["image"]["tag"] != kuberay.course_image_tag()


def test_the_dockerfile_builds_the_image_the_manifests_name():
    assert kuberay.dockerfile_errors() == []
    assert kuberay.course_image_tag() == "2.60.0-py311"
    dockerfile = (kuberay.DEPLOY_DIR / "Dockerfile").read_text()
    ignore = [line for line in (kuberay.DEPLOY_DIR / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert "COPY --chown=ray:users notebooks/*.py notebooks/" in dockerfile and "!notebooks/*.py" in ignore
    assert ignore == ["*", "!pyproject.toml", "!helpers/", "!notebooks/*.py", "**/__pycache__"]  # no .venv, .env


def test_the_token_secret_the_helm_values_read_is_a_valid_secret():
    secret = kuberay.auth_secret("0" * 64)
    assert kuberay.schema_errors(secret) == []
    assert secret["metadata"]["name"] == "ray-course-auth" and "auth_token" in secret["stringData"]


def _mutate(path: str):
    """A function that sets (or with value DELETE, removes) the field at a dotted path of a manifest."""
    *parents, last = path.split(".")

    def apply(doc, value):
        node = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is DELETE:
            del node[int(last) if last.isdigit() else last]
        elif last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return apply


DELETE = object()
HEAD = "spec.headGroupSpec.template.spec"
CPU = "spec.workerGroupSpecs.0"
INJECTED = [
    # schema: a misspelled field, a wrong type, a missing required field, a value outside an enum
    ("raycluster.yaml", "spec.workerGroupSpec", [], "'workerGroupSpec' was unexpected"),
    ("raycluster.yaml", f"{CPU}.replicas", "two", "'two' is not of type 'integer'"),
    ("raycluster.yaml", f"{CPU}.groupName", DELETE, "'groupName' is a required property"),
    ("raycluster.yaml", "spec.authOptions.mode", "Token", "'Token' is not one of ['disabled', 'token']"),
    ("raycluster.yaml", f"{HEAD}.containers.0.resources.limit", {"cpu": "2"}, "'limit' was unexpected"),
    ("rayjob.yaml", "spec.entrypointNumCPUs", 1, "'entrypointNumCPUs' was unexpected"),
    ("rayjob.yaml", "spec.shutdownAfterJobFinishes", "yes", "'yes' is not of type 'boolean'"),
    ("rayjob.yaml", "spec.rayClusterSpec.headGroupSpec.template", DELETE, "'template' is a required property"),
    ("storage-pvc.yaml", "spec.accessModes", "ReadWriteMany", "'ReadWriteMany' is not of type 'array'"),
    ("storage-pvc.yaml", "spec.acessModes", ["ReadWriteMany"], "'acessModes' was unexpected"),
    ("storage-pvc.yaml", "metadata.name", "Ray_Course", "not a valid name"),
    # the course's cross-checks
    ("storage-pvc.yaml", "spec.accessModes", ["ReadWriteOnce"], "it needs ReadWriteMany"),
    ("raycluster.yaml", f"{CPU}.template.spec.containers.0.volumeMounts.0.mountPath", "/mnt/data",
     f"at {CLUSTER_STORAGE} (found: ['/mnt/data'])"),
    ("raycluster.yaml", f"{HEAD}.volumes.0.persistentVolumeClaim.claimName", "other-claim", "mount the claim"),
    ("raycluster.yaml", f"{HEAD}.containers.0.env.0.value", "/tmp/runs", "would write to /tmp/runs"),
    ("raycluster.yaml", "spec.rayVersion", "2.52.0", "expected '2.60.0'"),
    ("raycluster.yaml", f"{HEAD}.containers.0.image", "rayproject/ray:2.52.0", "expected the course's image"),
    ("raycluster.yaml", f"{CPU}.template.spec.containers.0.image", "ray-course:2.60.0-py312", "course's image"),
    ("raycluster.yaml", "spec.headGroupSpec.rayStartParams", {}, "no training on the head"),
    ("raycluster.yaml", f"{CPU}.template.spec.containers.0.resources.limits.memory", "8Gi", "requests equal to them"),
    ("raycluster.yaml", f"{CPU}.template.spec.containers.0.resources",
     {"limits": {"cpu": "4", "memory": "1Gi"}, "requests": {"cpu": "4", "memory": "1Gi"}}, "at least 4Gi"),
    ("raycluster.yaml", "spec.workerGroupSpecs.1.template.spec.tolerations", DELETE, "needs a toleration"),
    ("raycluster.yaml", f"{CPU}.template.spec.securityContext", DELETE, "fsGroup"),
    ("raycluster.yaml", f"{CPU}.minReplicas", 2, "minReplicas <= replicas <= maxReplicas"),
    ("rayjob.yaml", "spec.entrypoint", "python /home/ray/course/notebooks/train.py --epochs 1", "not one of the"),
    ("rayjob.yaml", "spec.entrypoint", "python notebooks/train_ray_ddp.py --epochs 1", "not one of the"),
    ("rayjob.yaml", "spec.entrypoint", "python /home/ray/course/notebooks/train_ray_ddp.py --num-gpus 2",
     "unrecognized arguments: --num-gpus 2"),
    ("rayjob.yaml", "spec.entrypoint", "python /home/ray/course/notebooks/train_ray_ddp.py --epochs two",
     "invalid int value: 'two'"),
    ("rayjob.yaml", "spec.runtimeEnvYAML", "envvars: {A: '1'}\n", "spec.runtimeEnvYAML"),
    ("rayjob.yaml", "spec.runtimeEnvYAML", "env_vars: {COURSE_STORAGE_PATH: /home/ray/runs}\n",
     "would write to /home/ray/runs"),
    ("rayjob.yaml", "spec.shutdownAfterJobFinishes", False, "the cluster outlives the job"),
    # the data: every Ray pod reads the shared data folder and never downloads; the data Job fills it
    ("raycluster.yaml", f"{CPU}.template.spec.containers.0.env.1.value", "/home/ray/data",
     "env.COURSE_DATA_DIR: '/home/ray/data', expected '/mnt/cluster_storage/data'"),
    ("raycluster.yaml", f"{HEAD}.containers.0.env.2", DELETE, "COURSE_DATA_DOWNLOAD: set it to '0'"),
    ("rayjob.yaml", "spec.rayClusterSpec.workerGroupSpecs.1.template.spec.containers.0.env.2.value", "yes",
     "COURSE_DATA_DOWNLOAD: set it to '0'"),
    ("data-job.yaml", "spec.template.spec.containers.0.env.1.value", "0", "this Job is what downloads"),
    ("data-job.yaml", "spec.template.spec.containers.0.env.0.value", "/tmp/data", "COURSE_DATA_DIR: '/tmp/data'"),
    ("data-job.yaml", "spec.template.spec.containers.0.command.2", "import helpers", "command: expected"),
    ("data-job.yaml", "spec.activeDeadlineSeconds", DELETE, "spec.activeDeadlineSeconds: set it"),
    ("data-job.yaml", "spec.template.spec.containers.0.volumeMounts.0.mountPath", "/data", "mount the claim"),
    ("data-job.yaml", "spec.template.spec.containers.0.image", "python:3.11", "expected the course's image"),
    ("rayjob.yaml", "spec.submitterPodTemplate.spec.containers.0.image", "rayproject/ray:2.60.0",
     "spec.submitterPodTemplate: image 'rayproject/ray:2.60.0', expected the head's"),
    # the egress policy: where the Ray pods may connect out
    ("networkpolicy-egress.yaml", "spec.egress.2.to.0.ipBlock.cidr", "0.0.0.0/0",
     "the pods can reach an address on the internet (203.0.113.7, 443/TCP), and they should not"),
    ("networkpolicy-egress.yaml", "spec.egress.1.to.0", {"podSelector": {}},
     "the pods can reach any other pod in this namespace"),
    ("networkpolicy-egress.yaml", "spec.policyTypes", ["Ingress"], "can reach the cloud metadata endpoint"),
    ("networkpolicy-egress.yaml", "spec.egress.0.to.0.namespaceSelector", DELETE,
     "the pods cannot reach the cluster's DNS (kube-dns)"),
    ("networkpolicy-egress.yaml", "spec.egress.0.ports.0", DELETE, "cannot reach the cluster's DNS (kube-dns)"),
    ("networkpolicy-egress.yaml", "spec.egress.0.ports", DELETE, "the DNS pods, on another port"),
    ("networkpolicy-egress.yaml", "spec.egress.2", DELETE, "cannot reach the Kubernetes API server"),
    ("networkpolicy-egress.yaml", "spec.podSelector", {}, "selects the data Job's pod"),
    ("networkpolicy-egress.yaml", "spec.podSelector.matchLabels", {"ray.io/node-type": "worker"},
     "does not select the pods of group head"),
    # the NetworkPolicy: Kubernetes' schema, then who reaches which port
    ("networkpolicy.yaml", "spec.podSelector.matchLabel", {}, "'matchLabel' was unexpected"),
    ("networkpolicy.yaml", "spec.podSelector.matchLabels", {"app.kubernetes.io/part-of": "ray"},
     "does not select the pods of group head"),
    ("networkpolicy.yaml", "spec.ingress.1.from", [], "any other pod in this namespace can reach port 8265"),
    ("networkpolicy.yaml", "spec.ingress.1.ports", DELETE, "the KubeRay operator (kuberay-system) can reach port 6379"),
    ("networkpolicy.yaml", "spec.ingress.1.from.2", {"namespaceSelector": {}},
     "a Ray pod in another namespace can reach port 8265"),
    ("networkpolicy.yaml", "spec.ingress.0", {"from": [{"podSelector": {}}], "ports": [{"port": 8265}]},
     "a pod of the course's Ray clusters cannot reach port 6379"),
    ("networkpolicy.yaml", "spec.policyTypes", ["Egress"], "any other pod in this namespace can reach port 8265"),
    ("networkpolicy.yaml", "spec.ingress.1.from.1.podSelector.matchLabels", {"batch.kubernetes.io/job-name": "train"},
     "the RayJob's submitter pod cannot reach port 8265"),
]


@pytest.mark.parametrize("name, path, value, expected", INJECTED, ids=[f"{i[0]}:{i[1]}" for i in INJECTED])
def test_an_injected_mistake_fails(manifests, name, path, value, expected):
    broken = copy.deepcopy(manifests[name])
    _mutate(path)(broken, value)
    with pytest.raises(kuberay.ManifestError, match=re.escape(expected)):
        kuberay.validate(broken)


IMAGE_SCRIPTS = "python /home/ray/course/notebooks/"
#: Entrypoints each script's own parser takes: flags one script has and the others lack.
ACCEPTED_ENTRYPOINTS = [
    "train_ray_ddp.py --num-workers 2 --epochs 1 --use-gpu",
    "train_ray_ddp_with_ray_data.py --num-workers 2 --name my-run",
    "tune_ray_ddp.py --num-samples 4 --max-concurrent-trials 2 --epochs 3 --name my-search",
    "train_streaming.py --data-size-gb 0.5 --num-epochs 1 --json /tmp/report.json",
]


@pytest.mark.parametrize("entrypoint", ACCEPTED_ENTRYPOINTS, ids=[e.split()[0] for e in ACCEPTED_ENTRYPOINTS])
def test_each_script_s_flags_are_checked_by_its_own_parser(entrypoint):
    assert kuberay.entrypoint_errors(IMAGE_SCRIPTS + entrypoint) == []


@pytest.mark.parametrize("entrypoint, expected", [
    ("tune_ray_ddp.py --num-samples 4 --use-gpu",
     "tune_ray_ddp.py rejects its flags: unrecognized arguments: --use-gpu"),
    ("tune_ray_ddp.py --epochs 2", "tune_ray_ddp.py rejects its flags: argument --epochs: must be at least 3"),
    ("train_ray_ddp.py --num-samples 4", "train_ray_ddp.py rejects its flags: unrecognized arguments: --num-samples 4"),
    ("train_ray_ddp.py --name my-run", "train_ray_ddp.py rejects its flags: unrecognized arguments: --name my-run"),
    ("train_streaming.py --epochs 2", "train_streaming.py rejects its flags: unrecognized arguments: --epochs 2"),
])
def test_a_flag_the_script_does_not_take_fails_naming_that_script(entrypoint, expected):
    (error,) = kuberay.entrypoint_errors(IMAGE_SCRIPTS + entrypoint)
    assert error.startswith(f"spec.entrypoint: {expected}"), error


@pytest.mark.parametrize("path, value, expected", [
    ("head.resource", {}, "head.resource: the ray-cluster chart 1.7.0 has no such value"),
    ("worker.podSecurityContex", {}, "worker.podSecurityContex:"),
    ("additionalWorkerGroups.gpu.maxReplica", 4, "additionalWorkerGroups.gpu.maxReplica:"),
    ("imagee", {}, "imagee:"),
])
def test_a_misspelled_chart_value_fails(manifests, path, value, expected):
    values = copy.deepcopy(manifests["values.yaml"])
    _mutate(path)(values, value)
    assert any(error.startswith(expected) for error in kuberay.chart_key_errors(values))


@pytest.mark.parametrize("path, value, expected", [
    ("worker.replicas", "two", "'two' is not of type 'integer'"),
    ("additionalWorkerGroups.gpu.tolerations", DELETE, "needs a toleration"),
    ("image.tag", "2.52.0", "expected the course's image"),
    ("head.autoscalerOptions.env", DELETE, "autoscalerOptions: token auth needs RAY_AUTH_MODE=token"),
    ("common.containerEnv.1", {"name": "RAY_AUTH_TOKEN", "value": "in-git"}, "RAY_AUTH_TOKEN from a Secret"),
    ("head.volumeMounts.1.mountPath", "/data", "mount the claim"),
])
def test_a_wrong_chart_value_fails_once_rendered(manifests, path, value, expected):
    values = copy.deepcopy(manifests["values.yaml"])
    _mutate(path)(values, value)
    (rendered,) = kuberay.helm_template(values)
    with pytest.raises(kuberay.ManifestError, match=re.escape(expected)):
        kuberay.validate(rendered)


def test_the_network_policy_selects_the_pods_helm_makes(manifests):
    (rendered,) = kuberay.helm_template(kuberay.DEPLOY_DIR / "values.yaml")
    spec = rendered["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert kuberay.selects(manifests["networkpolicy.yaml"]["spec"]["podSelector"], labels)


def test_a_peer_with_both_selectors_needs_both_and_two_peers_need_either():
    # Kubernetes' rule: one `from` entry with namespaceSelector and podSelector is an AND; two entries are an OR.
    jupyter_ns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "notebooks"}}}
    jupyter_pod = {"podSelector": {"matchLabels": {"app": "jupyter"}}}
    dashboard = [{"port": 8265}]
    both = {"spec": {"podSelector": {}, "ingress": [{"from": [{**jupyter_ns, **jupyter_pod}], "ports": dashboard}]}}
    either = {"spec": {"podSelector": {}, "ingress": [{"from": [jupyter_ns, jupyter_pod], "ports": dashboard}]}}
    assert kuberay.admits(both, {"app": "jupyter"}, "notebooks", 8265)
    assert not kuberay.admits(both, {"app": "other"}, "notebooks", 8265)
    assert not kuberay.admits(both, {"app": "jupyter"}, "default", 8265)
    assert not kuberay.admits(both, {"app": "jupyter"}, "notebooks", 6379)
    assert kuberay.admits(either, {"app": "other"}, "notebooks", 8265)  # any pod of the namespace
    assert kuberay.admits(either, {"app": "jupyter"}, "ray-course", 8265)  # podSelector alone: the policy's namespace
    assert not kuberay.admits(either, {"app": "jupyter"}, "elsewhere", 8265)
    tier_in = {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]}
    assert kuberay.selects(tier_in, {"tier": "b"}) and not kuberay.selects(tier_in, {"tier": "c"})
    assert not kuberay.selects({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, {})


def test_a_dockerfile_on_another_ray_fails():
    dockerfile = (kuberay.DEPLOY_DIR / "Dockerfile").read_text()
    text = dockerfile.replace("rayproject/ray:2.60.0-py311", "rayproject/ray:2.52.0")
    assert kuberay.dockerfile_errors(text) == [
        "Dockerfile: FROM rayproject/ray:2.52.0@${RAY_IMAGE_DIGEST}, expected "
        "rayproject/ray:2.60.0-py311@${RAY_IMAGE_DIGEST} (the course's pins, the base image by digest)"]


@pytest.mark.parametrize("old, new, expected", [
    ("FROM rayproject/ray:2.60.0-py311@${RAY_IMAGE_DIGEST}", "FROM rayproject/ray:2.60.0-py311",
     "expected rayproject/ray:2.60.0-py311@${RAY_IMAGE_DIGEST}"),
    ("ARG RAY_IMAGE_DIGEST\n", "", "no `ARG RAY_IMAGE_DIGEST` before FROM"),
    ("ARG RAY_IMAGE_DIGEST\n", "ARG RAY_IMAGE_DIGEST=latest\n", "RAY_IMAGE_DIGEST=latest is not a digest"),
    ("pip install --no-cache-dir -e .", 'pip install --no-cache-dir -e ".[lab]"', "installs the extras ['lab']"),
    ("pip install --no-cache-dir -e .", "pip install --no-cache-dir jupyterlab",
     "does not install the course's pinned packages"),
])
def test_a_dockerfile_without_its_digest_or_with_more_than_the_training_fails(old, new, expected):
    dockerfile = (kuberay.DEPLOY_DIR / "Dockerfile").read_text()
    assert old in dockerfile
    (error,) = kuberay.dockerfile_errors(dockerfile.replace(old, new, 1))
    assert expected in error, error
    digest = "sha256:" + "0" * 64  # a fork that writes the digest it built from as the default passes
    pinned = dockerfile.replace("ARG RAY_IMAGE_DIGEST\n", f"ARG RAY_IMAGE_DIGEST={digest}\n")
    assert kuberay.dockerfile_errors(pinned) == []


def _project() -> dict:
    import tomllib

    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def test_the_image_installs_the_training_s_packages_and_not_the_lab_s():
    project = _project()
    installed = kuberay.image_requirements()
    assert installed == project["dependencies"]
    names = {_name(requirement) for requirement in installed}
    assert names.isdisjoint(_name(requirement) for requirement in project["optional-dependencies"]["lab"])
    assert names.isdisjoint({"jupyterlab", "ipykernel", "ipywidgets", "kubernetes-validate", "matplotlib"})


def _import_names(requirement: str) -> list[str]:
    """The top-level modules a requirement's distribution provides (from its installed metadata)."""
    import importlib.metadata

    provided = importlib.metadata.packages_distributions()
    return sorted(top for top, dists in provided.items() if _name(requirement) in {_name(d) for d in dists}
                  and not top.startswith("_") and top.isidentifier())


def test_every_package_the_image_installs_imports():
    # Checked offline: each package the Dockerfile's `pip install` installs (its pins, from pyproject.toml) is here at
    # the pinned version, and imports in a fresh interpreter.
    import importlib.metadata

    modules = {}
    for requirement in kuberay.image_requirements():
        name, _, version = requirement.partition("==")
        assert importlib.metadata.version(re.sub(r"\[.*\]", "", name)) == version, requirement
        modules[requirement] = _import_names(requirement)
        assert modules[requirement], f"{requirement} provides no importable module here"
    code = "; ".join(f"import {module}" for names in modules.values() for module in names
                     if module not in {"tests", "benchmarks", "docs"})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _third_party_imports(path: Path, seen: set[Path]) -> set[str]:
    """The top-level third-party modules `path` imports (lazily too), following imports of helpers modules."""
    import ast

    if path in seen:
        return set()
    seen.add(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top == "helpers":
                module = REPO_ROOT.joinpath(*name.split("."))
                for candidate in (module.with_suffix(".py"), module / "__init__.py"):
                    if candidate.is_file():
                        found |= _third_party_imports(candidate, seen)
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.add(top)
    return found


def test_the_training_code_imports_only_what_the_image_installs():
    # Every module the training scripts import (the helpers modules they reach, lazy imports included) comes from a
    # package the image installs: the pins of pyproject.toml's dependencies, or what those depend on.
    import importlib.metadata

    def parsed(requirement: str) -> tuple[str, frozenset[str]]:
        extras = re.findall(r"\[(.*?)\]", requirement.partition(";")[0])
        return _name(requirement), frozenset(e.strip() for e in extras[0].split(",")) if extras else frozenset()

    image = {_name(requirement) for requirement in kuberay.image_requirements()}
    closure: set[tuple[str, frozenset[str]]] = set()
    todo = [parsed(requirement) for requirement in kuberay.image_requirements()]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in closure:
            continue
        closure.add((name, extras))
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # a requirement for other platforms or Pythons
            continue
        for requirement in requirements:
            wanted = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", requirement.partition(";")[2])
            if not wanted or set(wanted) & extras:
                todo.append(parsed(requirement))
    installed = image | {name for name, _ in closure}
    provided = importlib.metadata.packages_distributions()
    scripts = sorted((REPO_ROOT / "notebooks").glob("*.py"))
    assert [p.name for p in scripts] == ["train_capstone.py", "train_fsdp.py", "train_ray_ddp.py",
                                         "train_ray_ddp_with_ray_data.py", "train_streaming.py", "tune_ray_ddp.py"]
    seen: set[Path] = set()
    modules = set().union(*(_third_party_imports(script, seen) for script in scripts))
    missing = {module: provided.get(module) for module in modules
               if module != "pynvml" and not {_name(d) for d in provided.get(module, [])} & installed}
    assert missing == {}, f"the training imports modules the image does not install: {missing}"
    assert {"ray", "torch", "torchvision", "filelock", "dotenv"} <= modules
    assert not {"matplotlib", "ipython", "jupyterlab", "ipykernel", "kubernetes-validate"} & installed


def _ray_containers(manifests) -> dict[str, dict]:
    """The Ray container of every group of raycluster.yaml, rayjob.yaml and the Helm-rendered cluster."""
    (rendered,) = kuberay.helm_template(kuberay.DEPLOY_DIR / "values.yaml")
    specs = {"raycluster.yaml": manifests["raycluster.yaml"]["spec"],
             "rayjob.yaml": manifests["rayjob.yaml"]["spec"]["rayClusterSpec"], "helm": rendered["spec"]}
    return {f"{source}:{group.get('groupName', 'head')}": group["template"]["spec"]["containers"][0]
            for source, spec in specs.items() for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]}


def test_every_ray_pod_reads_the_data_folder_on_the_shared_volume_and_never_downloads(manifests):
    containers = _ray_containers(manifests)
    assert len(containers) == 9
    for where, container in containers.items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["COURSE_DATA_DIR"] == "/mnt/cluster_storage/data" == str(kuberay.DATA_DIR), where
        assert env["COURSE_DATA_DOWNLOAD"] == "0", where
        assert load_config(env).data_dir == kuberay.DATA_DIR and not load_config(env).data_download, where
    job = manifests["data-job.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["value"] for e in job["env"]} == {"COURSE_DATA_DIR": "/mnt/cluster_storage/data",
                                                           "COURSE_DATA_DOWNLOAD": "1"}
    assert job["command"] == kuberay.FILL_COMMAND


def test_on_a_pod_without_data_the_training_stops_at_once_saying_how_to_fill_it(manifests, tmp_path, monkeypatch):
    # A CPU worker's environment, as raycluster.yaml sets it, with its data folder empty (the data Job not run).
    from helpers import data

    container = manifests["raycluster.yaml"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    for variable in container["env"]:
        monkeypatch.setenv(variable["name"], variable["value"])
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path / "data"))  # the empty volume, mounted here
    monkeypatch.setattr(data, "can_reach", lambda url, timeout=3.0: pytest.fail(f"it tried to reach {url}"))
    start = time.monotonic()
    with pytest.raises(data.DataNotFoundError) as error:
        data.load_mnist(load_config().data_dir, train=True)
    assert time.monotonic() - start < FAILS_FAST_S
    message = str(error.value)
    assert f"MNIST is not in {tmp_path / 'data' / 'MNIST' / 'raw'}" in message
    assert "downloads are off here (COURSE_DATA_DOWNLOAD=0)" in message
    assert "kubectl apply -f deploy/kuberay/data-job.yaml" in message and "COURSE_DATA_DOWNLOAD=1" in message
    assert not (tmp_path / "data").exists(), "nothing was written"


def test_the_data_job_s_command_fills_the_folder_once_and_keeps_a_whole_copy(manifests, tmp_path):
    # The Job's own command and environment, here: on a folder that already holds MNIST it downloads nothing.

    container = manifests["data-job.yaml"]["spec"]["template"]["spec"]["containers"][0]
    shutil.copytree(load_config().data_dir / "MNIST" / "raw", tmp_path / "data" / "MNIST" / "raw")
    env = {**{e["name"]: e["value"] for e in container["env"]}, "COURSE_DATA_DIR": str(tmp_path / "data"),
           "PYTHONPATH": str(REPO_ROOT), "PATH": os.environ["PATH"]}
    assert container["command"][0] == "python"  # the image's; here this environment's
    done = subprocess.run([sys.executable, *container["command"][1:]], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"MNIST was already in {tmp_path / 'data' / 'MNIST' / 'raw'}, whole: "), done.stdout


def test_missing_reference_files_fail_fast_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_KUBERAY_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(kuberay.reference, "RELEASE_URL", "http://127.0.0.1:9/")  # nothing listens: like being offline
    start = time.monotonic()
    with pytest.raises(kuberay.KubeRayReferenceError, match="set COURSE_KUBERAY_DIR to it"):
        kuberay.reference_dir()
    assert time.monotonic() - start < FAILS_FAST_S


def test_reference_files_are_downloaded_when_missing(tmp_path, monkeypatch):
    # The online path, from a local HTTP server serving the same release layout.
    import http.server
    import threading

    release = tmp_path / "release"
    for name, path in kuberay.REFERENCE_FILES.items():
        (release / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(kuberay.reference_dir() / name, release / path)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(release))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("COURSE_KUBERAY_DIR", str(tmp_path / "kuberay"))
        monkeypatch.setattr(kuberay.reference, "RELEASE_URL", f"http://127.0.0.1:{server.server_port}/")
        folder = kuberay.reference_dir()
    finally:
        server.shutdown()
    assert sorted(p.name for p in (folder / "crds").iterdir()) == ["ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml"]
    assert kuberay.chart_defaults()["image"]["repository"] == "rayproject/ray"


def test_cluster_commands_are_skipped_without_a_cluster_and_run_with_one(monkeypatch, capfd):
    monkeypatch.delenv("COURSE_KUBERNETES", raising=False)
    kuberay.on_cluster("echo ran")
    assert capfd.readouterr().out == "[needs a Kubernetes cluster: skipped] $ echo ran\n"
    monkeypatch.setenv("COURSE_KUBERNETES", "1")
    kuberay.on_cluster("echo ran")
    assert capfd.readouterr().out == "$ echo ran\nran\n"


def test_on_a_cluster_the_egress_policy_is_refused_while_it_holds_a_placeholder(monkeypatch, tmp_path, capfd):
    # Applied as the repository ships it (192.0.2.1, 198.51.100.10), the autoscaler could not reach the API server.
    monkeypatch.setenv("COURSE_KUBERNETES", "1")
    ran = []
    monkeypatch.setattr(kuberay.commands.subprocess, "run", lambda *a, **k: ran.append(a))
    command = "kubectl apply -f deploy/kuberay/networkpolicy-egress.yaml --request-timeout=30s"
    with pytest.raises(kuberay.ManifestError, match=r"spec.egress.2: 192.0.2.1/32 is a placeholder"):
        kuberay.on_cluster(command)
    assert ran == []
    # Filled as section 09 does it (sed: the API server's address, the storage rule deleted), it is applied and passes.
    filled = tmp_path / "networkpolicy-egress.yaml"
    text = (kuberay.DEPLOY_DIR / "networkpolicy-egress.yaml").read_text()
    filled.write_text(text.replace("192.0.2.1/32", "10.0.0.1/32")[: text.index("    # Your storage endpoint")])
    monkeypatch.setattr(kuberay.reference, "DEPLOY_DIR", tmp_path)
    for name in ("rayjob.yaml", "raycluster.yaml", "data-job.yaml"):
        shutil.copy(kuberay.DEPLOY_DIR / name, tmp_path / name)
    policy = kuberay.load_manifest("networkpolicy-egress.yaml")
    assert kuberay.placeholder_errors(policy) == [] and kuberay.egress_policy_errors(policy) == []
    kuberay.on_cluster(command)
    assert len(ran) == 1
    # A storage address left at its placeholder is refused too.
    assert kuberay.placeholder_errors(kuberay.reference.load_manifest("networkpolicy-egress.yaml")) == []
    policy["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "198.51.100.10/32"}}], "ports": [{"port": 9000}]})
    assert kuberay.placeholder_errors(policy) == [
        "spec.egress.3: 198.51.100.10/32 is a placeholder; set the address (section 09) or delete the rule"]


def test_the_course_s_image_may_carry_a_registry_and_a_tag_of_its_own_build():
    cluster = kuberay.load_manifest("raycluster.yaml")
    renamed = copy.deepcopy(cluster)
    for group in [renamed["spec"]["headGroupSpec"], *renamed["spec"]["workerGroupSpecs"]]:
        group["template"]["spec"]["containers"][0]["image"] = "registry.example.com/team/ray-course:2.60.0-py311-2611"
    assert kuberay.validate(renamed)
    for image in ("ray-course:2.60.0-py3110", "registry.example.com/not-ray-course:2.60.0-py311", "ray-course:latest"):
        wrong = copy.deepcopy(cluster)
        wrong["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] = image
        with pytest.raises(kuberay.ManifestError, match="expected the course's image"):
            kuberay.validate(wrong)


def test_the_install_step_runs_as_a_module():
    # `make install` runs `python -m helpers.tooling.kuberay --install-helm`; anything else prints the usage.
    done = subprocess.run([sys.executable, "-m", "helpers.tooling.kuberay"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "usage: python -m helpers.tooling.kuberay --install-helm" in done.stderr
