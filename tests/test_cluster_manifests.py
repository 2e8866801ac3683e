"""Offline validation of the deployment files in cluster/: KubeRay manifests, Dockerfile, Ray cluster launcher.

The manifests are checked against the KubeRay CRDs vendored in cluster/kuberay/crds (unknown fields rejected, as the
API server's strict field validation does), their serveConfigV2 against Ray Serve's schema and hetspec's
AppConfig, and the deployment choices (GPUs, ports, versions, sizing) against each other.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "cluster" / "kuberay"
MANIFESTS = ("rayservice.yaml", "rayservice.cpu.yaml")
SERVE_SOURCES = {"rayservice.yaml": "deployments/config.gpu.yaml", "rayservice.cpu.yaml": "deployments/config.yaml"}
ALL_MANIFESTS = sorted(path.name for path in KUBERAY.glob("*.yaml"))


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


validate = _load_module("kuberay_validate", KUBERAY / "validate.py")
sync = _load_module("kuberay_sync_serve_config", KUBERAY / "sync_serve_config.py")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _pin(package: str) -> str:
    """The ==version of ``package`` in pyproject.toml's dependencies or extras."""
    project = _pyproject()["project"]
    requirements = project["dependencies"] + [req for extra in project["optional-dependencies"].values()
                                              for req in extra]
    for requirement in requirements:
        match = re.fullmatch(rf"{re.escape(package)}(\[[\w,]+\])?==([\w.]+)", requirement)
        if match:
            return match.group(2)
    raise AssertionError(f"no {package}==X pin in pyproject.toml")


def _documents(name: str) -> list[dict]:
    return [document for document in yaml.safe_load_all((KUBERAY / name).read_text()) if document]


def _rayservice(name: str) -> dict:
    (service,) = [document for document in _documents(name) if document["kind"] == "RayService"]
    return service


def _serve_config(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def _app_args(service: dict) -> dict:
    (app,) = _serve_config(service)["applications"]
    return app["args"]


def _set(tree: dict, path: tuple, value) -> dict:
    """Copy of ``tree`` with ``value`` at ``path`` (keys and list indexes)."""
    tree = copy.deepcopy(tree)
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


def _head(service: dict) -> dict:
    return service["spec"]["rayClusterConfig"]["headGroupSpec"]


def _container(group: dict) -> dict:
    (container,) = group["template"]["spec"]["containers"]
    return container


def _env(group: dict) -> dict[str, str | None]:
    """The group's container's variables: name -> value (None for one taken from a secret)."""
    return {variable["name"]: variable.get("value") for variable in _container(group)["env"]}


def _cpu_quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# ---- the shared CRDs ------------------------------------------------------------------------------------

def test_the_vendored_crds_are_found_in_the_repository():
    folder = validate.kuberay_dir()
    assert folder == REPO / "cluster" / "kuberay" / "crds" and (folder / "ray.io_rayservices.yaml").is_file()
    assert validate.crd_schema("RayService")["properties"]["spec"]["additionalProperties"] is False


def test_missing_crds_fail_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HETSPEC_KUBERAY_DIR", str(tmp_path))
    with pytest.raises(validate.CRDsMissing, match="set HETSPEC_KUBERAY_DIR"):
        validate.kuberay_dir()


def test_closing_schemas_keeps_open_maps_and_preserved_fields_open():
    schema = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "when": {"type": "string", "nullable": True}}}
    closed = validate.close_object_schemas(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in closed["properties"]["free"]
    assert closed["properties"]["when"]["type"] == ["string", "null"]


# ---- manifests are valid and mirror deployments/ ----------------------------------------------------------

@pytest.mark.parametrize("name", ALL_MANIFESTS)
def test_manifest_is_valid(name):
    assert validate.file_errors(KUBERAY / name) == []


def test_every_embedded_serve_config_has_a_source():
    embedding = {name for name in ALL_MANIFESTS if "serveConfigV2" in (KUBERAY / name).read_text()}
    assert embedding == set(SERVE_SOURCES) == set(sync.MIRRORS)


@pytest.mark.parametrize("name", MANIFESTS)
def test_serve_config_mirrors_the_deployments_file(name):
    expected = yaml.safe_load((REPO / SERVE_SOURCES[name]).read_text())
    # The one deliberate difference: in a pod the proxy must listen on every interface for the serve Service.
    expected["http_options"]["host"] = "0.0.0.0"
    assert _serve_config(_rayservice(name)) == expected, (
        f"{name} no longer embeds {SERVE_SOURCES[name]}: run python cluster/kuberay/sync_serve_config.py")


def test_sync_is_a_no_op_on_the_committed_manifests():
    for name in sync.MIRRORS:
        assert sync.synced(name) == (KUBERAY / name).read_text(), (
            f"{name} drifted from its sources: run python cluster/kuberay/sync_serve_config.py")


def test_sync_writes_the_pods_environment_from_deployments_cpu_env():
    text = (KUBERAY / "rayservice.cpu.yaml").read_text()
    changed = sync.with_env(text, {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "2.0", "NEW_ONE": 'a "b"'},
                            "deployments/cpu.env")
    cluster = yaml.safe_load(changed)["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]):
        env = _env(group)
        assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "2.0" and env["NEW_ONE"] == 'a "b"'
        assert "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS" not in env, "a variable the file dropped leaves the pods"
        assert env["HF_HUB_OFFLINE"] == "1" and (group is cluster["headGroupSpec"] or "HETSPEC_API_KEY" in env)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_sets_the_proxys_key_check_and_grpc_message_bound_as_the_local_server_does(name):
    """Serve's proxies run in the pods: the API key checked before routing (deployments/proxy.py) needs the callback
    and the key in their environment, the gRPC bound its variable (deployments/tools/local_serve.py sets both)."""
    from deployments.config import GRPC_MAX_MESSAGE_BYTES

    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        env = _env(group)
        assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "deployments.proxy:proxy_middlewares"
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(GRPC_MAX_MESSAGE_BYTES)
        assert "HETSPEC_API_KEY" in env  # from the Secret


# ---- negative cases: the validator must catch typos and wrong types ----------------------------------

WORKER = ("spec", "rayClusterConfig", "workerGroupSpecs", 0)
KUBERNETES_BREAKAGES = {
    "misspelled worker group field": (WORKER + ("minReplica",), 1, "'minReplica' was unexpected"),
    "misspelled container field": (WORKER + ("template", "spec", "containers", 0, "resource"), {}, "'resource'"),
    "misspelled top-level spec field": (("spec", "serveConfig"), "x", "'serveConfig' was unexpected"),
    "wrong type of maxReplicas": (WORKER + ("maxReplicas",), "eight", "'eight' is not of type 'integer'"),
    "wrong type of a boolean": (("spec", "rayClusterConfig", "enableInTreeAutoscaling"), "yes", "not of type"),
    "auth mode outside the enum": (("spec", "rayClusterConfig", "authOptions", "mode"), "password", "is not one of"),
    "bad object name": (("metadata", "name"), "Het_Spec", "does not match"),
}


@pytest.mark.parametrize("breakage", KUBERNETES_BREAKAGES, ids=list(KUBERNETES_BREAKAGES))
def test_kubernetes_errors_are_caught(breakage):
    path, value, expected = KUBERNETES_BREAKAGES[breakage]
    broken = _set(_rayservice("rayservice.yaml"), path, value)
    problems = validate.kubernetes_errors(broken)
    assert any(expected in problem for problem in problems), problems


def test_pvc_errors_are_caught():
    (claim,) = [document for document in _documents("rayservice.yaml") if document["kind"] == "PersistentVolumeClaim"]
    assert validate.kubernetes_errors(claim) == []
    assert validate.kubernetes_errors(_set(claim, ("spec", "accessMode"), ["ReadWriteMany"]))
    assert validate.kubernetes_errors(_set(claim, ("spec", "resources", "requests", "storage"), "lots"))


APP = ("applications", 0)
SERVE_BREAKAGES = {
    "misspelled Serve field": (APP + ("route_prefx",), "/", "route_prefx: unknown key"),
    "misspelled nested Serve field": (("grpc_options", "grpc_servicer_function"), [], "grpc_servicer_function"),
    "misspelled Serve autoscaling field": (
        APP + ("deployments",), [{"name": "Coordinator", "autoscaling_config": {"min_replica": 1}}],
        "deployments[0].autoscaling_config.min_replica: unknown key"),
    "wrong Serve type": (("http_options", "port"), "eighty", "Ray Serve schema"),
    "misspelled hetspec field": (APP + ("args", "speculation", "draft_token"), 4, "speculation.draft_token"),
    "misspelled hetspec top-level field": (APP + ("args", "drafter_resource"), {}, "drafter_resource"),
    "wrong hetspec type": (APP + ("args", "pipeline", "max_sessions"), "many", "hetspec AppConfig"),
    "hetspec value out of range": (APP + ("args", "target", "dtype"), "int4", "hetspec AppConfig"),
    "user_config of a section that needs a redeploy": (
        APP + ("deployments",), [{"name": "HetSpecServer", "user_config": {"target": {"model": "x"}}}],
        "change args.target and redeploy"),
    "user_config value out of range": (
        APP + ("deployments",), [{"name": "HetSpecServer", "user_config": {"speculation": {"draft_tokens": 0}}}],
        "user_config.speculation.draft_tokens"),
    "pip at pod start": (APP + ("runtime_env",), {"pip": ["hetspec"]}, "'pip' would install"),
    "code downloaded at pod start": (APP + ("runtime_env",), {"working_dir": "https://x/y.zip"}, "'working_dir'"),
}


@pytest.mark.parametrize("breakage", SERVE_BREAKAGES, ids=list(SERVE_BREAKAGES))
def test_serve_config_errors_are_caught(breakage):
    path, value, expected = SERVE_BREAKAGES[breakage]
    service = _rayservice("rayservice.yaml")
    broken_serve_config = _set(_serve_config(service), path, value)
    problems = validate.serve_config_errors(broken_serve_config)
    assert any(expected in problem for problem in problems), problems
    # and through the whole manifest, as the CLI reads it
    broken_service = _set(service, ("spec", "serveConfigV2"), yaml.safe_dump(broken_serve_config))
    assert validate.manifest_errors(broken_service)


def test_environment_variables_are_allowed_in_runtime_env():
    serve_config = _set(_serve_config(_rayservice("rayservice.yaml")), APP + ("runtime_env",),
                        {"env_vars": {"HF_HUB_OFFLINE": "1"}})
    assert validate.serve_config_errors(serve_config) == []


# ---- deployment choices agree with each other -------------------------------------------------------------

@pytest.mark.parametrize("name", MANIFESTS)
def test_versions_and_images_follow_pyproject(name):
    service = _rayservice(name)
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _pin("ray")
    flavour = "gpu" if name == "rayservice.yaml" else "cpu"
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert {_container(group)["image"] for group in groups} == {
        f"hetspec:{_pyproject()['project']['version']}-{flavour}"}


@pytest.mark.parametrize("name", MANIFESTS)
def test_head_exposes_the_serve_ports_the_serve_config_uses(name):
    service = _rayservice(name)
    ports = {port["name"]: port["containerPort"] for port in _container(_head(service))["ports"]}
    serve_config = _serve_config(service)
    assert ports["serve"] == serve_config["http_options"]["port"] == 8000
    assert ports["serve-grpc"] == serve_config["grpc_options"]["port"] == 9000
    assert service["spec"]["rayClusterConfig"]["authOptions"]["mode"] == "token"


def test_gpu_manifest_puts_models_on_gpu_workers_only():
    service = _rayservice("rayservice.yaml")
    cluster = service["spec"]["rayClusterConfig"]
    head = _head(service)
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in str(_container(head)["resources"])
    assert cluster["enableInTreeAutoscaling"] is True
    (gpu_group,) = cluster["workerGroupSpecs"]
    pod = gpu_group["template"]["spec"]
    assert _container(gpu_group)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert 0 < gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]


def test_gpu_workers_fit_the_pipelines_the_serve_config_asks_for():
    service = _rayservice("rayservice.yaml")
    (gpu_group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = _container(gpu_group)["resources"]["limits"]
    pod_cpus, pod_gpus = _cpu_quantity(limits["cpu"]), float(limits["nvidia.com/gpu"])
    args = _app_args(service)
    bundles = [args.get(f"{role}_resources", {}) for role in ("coordinator", "drafter", "target")]
    for bundle in bundles:  # a bundle larger than any pod would never be scheduled
        assert bundle.get("num_cpus", 1.0) <= pod_cpus and bundle.get("num_gpus", 0.0) <= pod_gpus
    assert args["pipeline"]["placement_strategy"] in ("SPREAD", "STRICT_SPREAD")
    gpus_per_pipeline = sum(bundle.get("num_gpus", 0.0) for bundle in bundles)
    autoscaling = args["autoscaling"]
    assert gpu_group["minReplicas"] * pod_gpus >= autoscaling["min_replicas"] * gpus_per_pipeline
    assert gpu_group["maxReplicas"] * pod_gpus >= autoscaling["max_replicas"] * gpus_per_pipeline


def test_gpu_manifest_reads_secrets_and_caches_models_on_a_volume():
    documents = _documents("rayservice.yaml")
    (claim,) = [document for document in documents if document["kind"] == "PersistentVolumeClaim"]
    (gpu_group,) = _rayservice("rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    container = _container(gpu_group)
    env = {variable["name"]: variable for variable in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    volumes = {volume["name"]: volume for volume in gpu_group["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = [mount for mount in container["volumeMounts"] if mount["name"] == "model-cache"]
    for variable in ("HF_HOME", "HETSPEC_CACHE"):
        assert env[variable]["value"].startswith(mount["mountPath"] + "/")


def test_cpu_manifest_runs_one_pipeline_offline_on_its_worker():
    service = _rayservice("rayservice.cpu.yaml")
    (worker,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    container = _container(worker)
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert _env(worker)["HF_HUB_OFFLINE"] == "1"
    args = _app_args(service)
    assert args["pipeline"]["placement_strategy"] == "PACK"
    needed_cpus = sum(args[f"{role}_resources"]["num_cpus"] for role in ("coordinator", "drafter", "target"))
    assert needed_cpus <= _cpu_quantity(container["resources"]["limits"]["cpu"])


@pytest.mark.parametrize("pod", ["head", "worker"])
def test_both_pods_of_the_cpu_manifest_carry_deployments_cpu_env(pod):
    """The head runs Serve's controller and proxy, the worker the replicas: both read the file's variables."""
    from deployments.runtime.cpu_env import cpu_env

    cluster = _rayservice("rayservice.cpu.yaml")["spec"]["rayClusterConfig"]
    group = cluster["headGroupSpec"] if pod == "head" else cluster["workerGroupSpecs"][0]
    env = _env(group)
    assert {name: env.get(name) for name in cpu_env()} == cpu_env()


# ---- Dockerfile -------------------------------------------------------------------------------------------

def _dockerfile_args() -> dict[str, str]:
    text = (REPO / "cluster" / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=\"?([^\"\n]*)\"?$", text, re.MULTILINE))


def test_dockerfile_base_matches_the_ray_pin():
    text = (REPO / "cluster" / "Dockerfile").read_text()
    args = _dockerfile_args()
    assert args["RAY_VERSION"] == _pin("ray")
    assert args["TORCH_VERSION"] == _pin("torch")
    assert args["RAY_IMAGE_FLAVOR"] == "py311-cpu"
    (base,) = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert base == "rayproject/ray:${RAY_VERSION}-${RAY_IMAGE_FLAVOR}"


def test_dockerfile_copies_what_its_ignore_file_lets_through():
    text = (REPO / "cluster" / "Dockerfile").read_text()
    sources = [source for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.MULTILINE)
               for source in line.split()]
    allowed = (REPO / "cluster" / "Dockerfile.dockerignore").read_text().split()
    for source in sources:
        assert f"!{source.rstrip('*')}" in allowed or f"!{source}/" in allowed, source
        if "*" not in source:
            assert (REPO / source).exists(), source


# ---- Ray cluster launcher ---------------------------------------------------------------------------------

def _launcher_config() -> dict:
    return yaml.safe_load((REPO / "cluster" / "ray" / "cluster.yaml").read_text())


def _launcher_errors(config: dict) -> str | None:
    from ray.autoscaler._private.util import prepare_config, validate_config
    try:
        validate_config(prepare_config(copy.deepcopy(config)))
    except Exception as error:  # jsonschema's ValidationError or Ray's ValueError
        return str(error)
    return None


def test_launcher_config_is_valid_for_ray():
    assert _launcher_errors(_launcher_config()) is None


@pytest.mark.parametrize("path, value", [
    (("available_node_types", "gpu", "min_worker"), 1),
    (("docker", "imag"), "hetspec"),
    (("max_workers",), "eight"),
])
def test_launcher_config_errors_are_caught(path, value):
    assert _launcher_errors(_set(_launcher_config(), path, value)) is not None


def test_launcher_config_runs_the_image_with_token_auth_and_room_for_the_pipelines():
    config = _launcher_config()
    assert config["docker"]["image"] == f"hetspec:{_pyproject()['project']['version']}-gpu"
    assert "-e RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert not any(config[key] for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"))
    args = _app_args({"spec": {"serveConfigV2": (REPO / "deployments" / "config.gpu.yaml").read_text()}})
    gpus_per_pipeline = args["drafter_resources"]["num_gpus"] + args["target_resources"]["num_gpus"]
    most_gpus_needed = args["autoscaling"]["max_replicas"] * gpus_per_pipeline
    assert config["available_node_types"]["gpu"]["max_workers"] >= most_gpus_needed
