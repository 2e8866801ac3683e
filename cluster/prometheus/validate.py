"""Offline check of cluster/prometheus/podmonitor.yaml against the Prometheus Operator's PodMonitor CRD (vendored in
cluster/prometheus/crds, see its README), as strict as a real cluster: every object schema that lists
``properties`` without ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields`` is closed, as
cluster/kuberay/validate.py does for KubeRay's CRDs (its ``close_object_schemas`` and ObjectMeta schema are reused).

Not checked: CEL rules (``x-kubernetes-validations``) and Go-only regex syntax.

Usage: ``python cluster/prometheus/validate.py [MANIFEST ...]`` (default: podmonitor.yaml beside this file).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

HERE = Path(__file__).resolve().parent
CRD_FILE = "monitoring.coreos.com_podmonitors.yaml"


def _kuberay_validate():
    spec = importlib.util.spec_from_file_location("kuberay_validate", HERE.parent / "kuberay" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def crd_dir() -> Path:
    """The vendored CRD (cluster/prometheus/crds); ``HETSPEC_PROMETHEUS_OPERATOR_DIR`` overrides it."""
    folder = Path(os.environ.get("HETSPEC_PROMETHEUS_OPERATOR_DIR", HERE / "crds"))
    if not (folder / CRD_FILE).is_file():
        raise FileNotFoundError(f"{CRD_FILE} not found in {folder}: set HETSPEC_PROMETHEUS_OPERATOR_DIR to a folder "
                                "that holds it, or unset it to use the vendored copy in cluster/prometheus/crds")
    return folder


@lru_cache(maxsize=None)
def pod_monitor_schema() -> dict:
    """The closed v1 schema of a PodMonitor, with ObjectMeta filled in."""
    kuberay = _kuberay_validate()
    crd = yaml.safe_load((crd_dir() / CRD_FILE).read_text())
    version = next(version for version in crd["spec"]["versions"] if version["name"] == "v1")
    schema = kuberay.close_object_schemas(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = kuberay.OBJECT_META_SCHEMA
    schema["properties"]["apiVersion"] = {"const": "monitoring.coreos.com/v1"}
    schema["properties"]["kind"] = {"const": "PodMonitor"}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


def manifest_errors(manifest: dict) -> list[str]:
    """Messages for every place a PodMonitor breaks its schema (empty when it is valid)."""
    validator = jsonschema.Draft202012Validator(pod_monitor_schema())
    return [f"{manifest.get('kind')} .{'.'.join(map(str, error.absolute_path))}: {error.message}"
            for error in sorted(validator.iter_errors(manifest), key=lambda error: list(error.absolute_path))]


def file_errors(path: Path) -> list[str]:
    return _kuberay_validate().file_errors(path, manifest_errors)


def main(argv: list[str]) -> int:
    return _kuberay_validate().report([Path(arg) for arg in argv] or [HERE / "podmonitor.yaml"], file_errors)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
