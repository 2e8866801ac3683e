"""cluster/prometheus/: the rules pass ``promtool check rules`` and their unit tests (``promtool test rules``:
synthetic series in, the expected alerts out), and every alert has a case that fires and one that stays quiet.

promtool comes with Debian's prometheus package, which scripts/setup.sh installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES_DIR = Path(__file__).resolve().parent.parent / "cluster" / "prometheus"
RULES = RULES_DIR / "hetspec.rules.yaml"
RULE_TESTS = RULES_DIR / "hetspec.rules.test.yaml"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run scripts/setup.sh (it installs Debian's prometheus package)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules():
    checked = run_promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout


def test_promtool_unit_tests_of_the_alerts_pass():
    tested = run_promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
              if "alert" in rule}
    assert alerts == {"HetSpecErrorRatioHigh", "HetSpecKVBudgetNearFull", "HetSpecWaitingQueueGrowing",
                      "HetSpecReplicaRestarting", "HetSpecReplicaUnhealthy", "HetSpecActorReplaced",
                      "HetSpecAcceptanceCollapse", "HetSpecTimeToFirstTokenAboveSLO"}
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    # a look-alike series that must not alert stands beside each firing case (r2 in the test file)
    assert fired == alerts, sorted(alerts - fired)
    assert {"HetSpecErrorRatioHigh", "HetSpecKVBudgetNearFull", "HetSpecReplicaRestarting", "HetSpecReplicaUnhealthy",
            "HetSpecActorReplaced", "HetSpecAcceptanceCollapse"} <= quiet


def test_a_broken_threshold_fails_the_unit_tests(tmp_path):
    """The unit tests can fail: the error-ratio alert at 10% instead of 5% no longer fires on 9% errors."""
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("hetspec:request_errors:ratio_rate5m > 0.05",
                                                                 "hetspec:request_errors:ratio_rate5m > 0.10"))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    tested = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert tested.returncode != 0 and "HetSpecErrorRatioHigh" in tested.stdout + tested.stderr


def _load_validator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prometheus_validate", RULES_DIR / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pod_monitor_matches_the_prometheus_operator_crd():
    validate = _load_validator()
    assert validate.crd_dir() == RULES_DIR / "crds" and (RULES_DIR / "crds" / "LICENSE").is_file()
    assert validate.file_errors(RULES_DIR / "podmonitor.yaml") == []


def test_the_pod_monitor_validation_rejects_what_a_cluster_would():
    import copy

    validate = _load_validator()
    monitor = yaml.safe_load((RULES_DIR / "podmonitor.yaml").read_text())
    misspelled = copy.deepcopy(monitor)
    misspelled["spec"]["podMetricsEndpoint"] = misspelled["spec"].pop("podMetricsEndpoints")
    assert any("podMetricsEndpoint" in problem for problem in validate.manifest_errors(misspelled))
    bad_action = copy.deepcopy(monitor)
    bad_action["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "keep-it"
    assert validate.manifest_errors(bad_action)
    no_selector = copy.deepcopy(monitor)
    del no_selector["spec"]["selector"]
    assert any("selector" in problem for problem in validate.manifest_errors(no_selector))


def test_the_pod_monitor_scrapes_the_rayservice_metrics_port():
    """The port it names is the head's metrics port in cluster/kuberay/rayservice.yaml; a worker container that
    declares none gets KubeRay's default (``metrics``, 8080), and one that does must use that port."""
    monitor = yaml.safe_load((RULES_DIR / "podmonitor.yaml").read_text())
    manifests = yaml.safe_load_all((RULES_DIR.parent / "kuberay" / "rayservice.yaml").read_text())
    service = next(document for document in manifests if document and document["kind"] == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"], *(group["template"] for group in cluster["workerGroupSpecs"])]
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    for pod in pods:
        ports = {port.get("name"): port["containerPort"] for port in pod["spec"]["containers"][0].get("ports", [])}
        assert ports.get(endpoint["port"], 8080 if pod is not pods[0] else None) == 8080, ports
    assert endpoint["relabelings"][0]["regex"] == f"{service['metadata']['name']}-.*"
