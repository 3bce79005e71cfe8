"""Manifests checked against their schemas (KubeRay's CRDs, Kubernetes' own), and Helm values key by key against
the chart's defaults."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import kubernetes_validate

from helpers.tooling.kuberay.course import course_errors
from helpers.tooling.kuberay.reference import (
    CRD_FILES,
    KUBERAY_VERSION,
    KUBERNETES_VERSION,
    ManifestError,
    chart_defaults,
    crd_schema,
)

#: Keys the chart's templates read that its values.yaml documents only in comments (`# rayVersion: ...`).
CHART_COMMENTED_KEYS = {"head": {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions"}, "worker": {"disabled"}}
#: Chart values handed to the RayCluster as they are: checked against the CRD's schema, not key by key.
CHART_PASS_THROUGH = {"containerEnv", "envFrom", "resources", "volumes", "volumeMounts", "podSecurityContext",
                      "securityContext", "tolerations", "nodeSelector", "affinity", "labels", "annotations",
                      "rayStartParams", "autoscalerOptions", "headService", "initContainers", "sidecarContainers",
                      "topologySpreadConstraints", "imagePullSecrets", "resourceClaims", "command", "args"}
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


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

