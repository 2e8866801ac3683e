"""Offline checks of the KubeRay manifests, as strict as a real cluster would be.

Two layers are checked, because the API server sees only the first:

1. The Kubernetes object against the KubeRay CRD's ``openAPIV3Schema``. The API server prunes unknown
   fields and ``kubectl`` (strict field validation) rejects them, so every object schema that lists
   ``properties`` without ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields`` is closed
   here with ``additionalProperties: false``.
2. ``serveConfigV2``, a plain string to the CRD, against Ray Serve's ``ServeDeploySchema`` (which ignores
   unknown keys, so keys are also checked against the pydantic fields, recursively), hetspec's
   ``deployments.config.AppConfig`` for each application's ``args``, and a rule of this project: nothing
   is installed or downloaded at pod start (``runtime_env`` may only set environment variables).

Not checked: CEL rules (``x-kubernetes-validations``; this CRD only has them on ``managedBy``, unused
here), Go-only regex syntax, and core objects beyond a hand-written PersistentVolumeClaim schema and a
few ObjectMeta fields.

Usage: ``python cluster/kuberay/validate.py [MANIFEST ...]`` (default: every ``*.yaml`` beside this file).
"""

from __future__ import annotations

import os
import sys
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from pydantic import BaseModel

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# Only environment variables: pip/uv/conda/working_dir/py_modules would install or download at pod start.
ALLOWED_RUNTIME_ENV_KEYS = frozenset({"env_vars"})
# The ObjectMeta fields a manifest may set (the server fills in the rest).
OBJECT_META_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9.]+([KMGTPE]i?|[mkn])?$"}]}
# Core objects that sit beside a RayService in a manifest; no schema for them is available offline, so
# this is the PersistentVolumeClaim spec's field list (Kubernetes v1) with the types this project uses.
CORE_SCHEMAS = {
    "PersistentVolumeClaim": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "v1"},
            "kind": {"const": "PersistentVolumeClaim"},
            "metadata": OBJECT_META_SCHEMA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["accessModes", "resources"],
                "properties": {
                    "accessModes": {"type": "array", "minItems": 1, "items": {
                        "enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
                    "resources": {"type": "object", "additionalProperties": False, "properties": {
                        "requests": {"type": "object", "additionalProperties": QUANTITY},
                        "limits": {"type": "object", "additionalProperties": QUANTITY}}},
                    "storageClassName": {"type": "string"},
                    "volumeMode": {"enum": ["Filesystem", "Block"]},
                    "volumeName": {"type": "string"},
                    "selector": {"type": "object"},
                    "dataSource": {"type": "object"},
                    "dataSourceRef": {"type": "object"},
                    "volumeAttributesClassName": {"type": "string"},
                },
            },
        },
    },
}


class CRDsMissing(FileNotFoundError):
    """The KubeRay CRDs are not in the folder named by HETSPEC_KUBERAY_DIR."""


def kuberay_dir() -> Path:
    """The vendored CRDs (cluster/kuberay/crds, see its README); ``HETSPEC_KUBERAY_DIR`` overrides them."""
    folder = Path(os.environ.get("HETSPEC_KUBERAY_DIR", REPO_ROOT / "cluster" / "kuberay" / "crds"))
    missing = [name for name in CRD_FILES.values() if not (folder / name).is_file()]
    if missing:
        raise CRDsMissing(f"KubeRay CRDs {missing} not found in {folder}: set HETSPEC_KUBERAY_DIR to a folder that "
                          "holds them, or unset it to use the vendored copy in cluster/kuberay/crds")
    return folder


def close_object_schemas(schema: Any) -> Any:
    """Copy of an OpenAPI v3 schema with unknown fields rejected, as strict field validation does.

    Also maps the OpenAPI-only ``nullable: true`` onto JSON Schema's ``"null"`` type.
    """
    if isinstance(schema, list):
        return [close_object_schemas(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key == "properties":
            closed[key] = {name: close_object_schemas(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
            closed[key] = close_object_schemas(value)
        else:
            closed[key] = value
    preserves_unknown = schema.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in schema and "additionalProperties" not in schema and not preserves_unknown:
        closed["additionalProperties"] = False
    if schema.get("nullable") and isinstance(schema.get("type"), str):
        closed["type"] = [schema["type"], "null"]
    return closed


@lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    """The closed v1 schema of a KubeRay kind, with ObjectMeta filled in."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 18k lines: libyaml is 10x faster
    crd = yaml.load((kuberay_dir() / CRD_FILES[kind]).read_text(), Loader=loader)
    version = next(version for version in crd["spec"]["versions"] if version["name"] == "v1")
    schema = close_object_schemas(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META_SCHEMA
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


def kubernetes_errors(manifest: dict) -> list[str]:
    """Messages for every place an object breaks its schema (empty when it is valid)."""
    kind = manifest.get("kind")
    if kind in CRD_FILES:
        schema = crd_schema(kind)
    elif kind in CORE_SCHEMAS:
        schema = CORE_SCHEMAS[kind]
    else:
        return [f"kind {kind!r} is not one this validator knows ({sorted(CRD_FILES) + sorted(CORE_SCHEMAS)})"]
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{kind} .{'.'.join(map(str, error.absolute_path))}: {error.message}"
            for error in sorted(validator.iter_errors(manifest), key=lambda error: list(error.absolute_path))]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation (possibly Optional/Union) describes a dict with, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for member in typing.get_args(annotation):
            model = _model_in(member)
            if model is not None:
                return model
    return None


def _item_annotation(annotation: Any) -> Any | None:
    """The element type of a (possibly Optional) list annotation, if it is one."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is list:
            return typing.get_args(candidate)[0]
    return None


def unknown_keys(value: Any, annotation: Any, path: str = "") -> list[str]:
    """Keys in ``value`` that no field of the pydantic model(s) in ``annotation`` declares, recursively.

    Free-form parts (``Dict``, ``Any``, ``dict``) are not descended into.
    """
    model = _model_in(annotation)
    if model is not None and isinstance(value, dict):
        by_key = {}
        for name, field in model.model_fields.items():
            by_key[name] = field
            if field.alias:
                by_key[field.alias] = field
        problems = []
        for key, sub_value in value.items():
            if key not in by_key:
                problems.append(f"{path}{key}: unknown key (known: {', '.join(sorted(model.model_fields))})")
            else:
                problems += unknown_keys(sub_value, by_key[key].annotation, f"{path}{key}.")
        return problems
    item = _item_annotation(annotation)
    if item is not None and isinstance(value, list):
        return [problem for index, element in enumerate(value)
                for problem in unknown_keys(element, item, f"{path.rstrip('.')}[{index}].")]
    return []


def _runtime_env_problems(serve_config: dict) -> list[str]:
    places = []
    for app_index, app in enumerate(serve_config.get("applications") or []):
        places.append((f"applications[{app_index}].runtime_env", app.get("runtime_env")))
        for dep_index, deployment in enumerate(app.get("deployments") or []):
            actor_options = deployment.get("ray_actor_options") or {}
            places.append((f"applications[{app_index}].deployments[{dep_index}].ray_actor_options.runtime_env",
                           actor_options.get("runtime_env")))
    return [f"{place}: {key!r} would install or download at pod start; bake it into the image "
            f"(cluster/Dockerfile); runtime_env may only set {sorted(ALLOWED_RUNTIME_ENV_KEYS)}"
            for place, runtime_env in places if isinstance(runtime_env, dict)
            for key in runtime_env if key not in ALLOWED_RUNTIME_ENV_KEYS]


def serve_config_errors(serve_config: Any) -> list[str]:
    """Messages for every problem in a Serve config (the parsed ``serveConfigV2``); empty when valid."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import SERVER_DEPLOYMENT, AppConfig, InvalidUserConfig, with_user_config

    if not isinstance(serve_config, dict):
        return [f"serveConfigV2 must be a YAML mapping, got {type(serve_config).__name__}"]
    problems = [f"serveConfigV2 {problem}" for problem in unknown_keys(serve_config, ServeDeploySchema)]
    try:
        ServeDeploySchema.model_validate(serve_config)
    except ValidationError as error:
        problems.append(f"serveConfigV2 (Ray Serve schema): {error}")
    problems += [f"serveConfigV2 {problem}" for problem in _runtime_env_problems(serve_config)]
    for index, app in enumerate(serve_config.get("applications") or []):
        args = app.get("args", {}) if isinstance(app, dict) else {}
        where = f"serveConfigV2 applications[{index}].args"
        problems += [f"{where}.{problem}" for problem in unknown_keys(args, AppConfig)]
        try:
            config = AppConfig.model_validate(args)
        except ValidationError as error:
            problems.append(f"{where} (hetspec AppConfig): {error}")
            continue
        # a user_config is only checked by the running replicas, whose update then fails: check it before
        for dep_index, deployment in enumerate(app.get("deployments") or []):
            if isinstance(deployment, dict) and deployment.get("name") == SERVER_DEPLOYMENT:
                try:
                    with_user_config(config, deployment.get("user_config"))
                except InvalidUserConfig as error:
                    problems.append(f"serveConfigV2 applications[{index}].deployments[{dep_index}] "
                                    f"(hetspec user_config): {error}")
    return problems


def manifest_errors(manifest: dict) -> list[str]:
    """Both layers for one Kubernetes object (a parsed YAML document)."""
    problems = kubernetes_errors(manifest)
    serve_config_text = (manifest.get("spec") or {}).get("serveConfigV2")
    if isinstance(serve_config_text, str):
        try:
            serve_config = yaml.safe_load(serve_config_text)
        except yaml.YAMLError as error:
            return problems + [f"serveConfigV2 is not valid YAML: {error}"]
        problems += serve_config_errors(serve_config)
    return problems


def file_errors(path: Path, errors_of=None) -> list[str]:
    """Each YAML document's problems by ``errors_of`` (this file's ``manifest_errors`` unless given; also the
    checker of cluster/prometheus/validate.py)."""
    errors_of = errors_of or manifest_errors
    documents = [document for document in yaml.safe_load_all(path.read_text()) if document]
    if not documents:
        return [f"{path}: no YAML document"]
    return [f"{path}: {problem}" for document in documents for problem in errors_of(document)]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO_ROOT))  # deployments.config, when run as a script
    return report([Path(arg) for arg in argv] or sorted(Path(__file__).parent.glob("*.yaml")), file_errors)


def report(paths: list[Path], errors_of) -> int:
    """Print each file's problems (``errors_of(path)``) and a count; the exit status (also for
    cluster/prometheus/validate.py)."""
    problems = [problem for path in paths for problem in errors_of(path)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(paths)} manifest(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
