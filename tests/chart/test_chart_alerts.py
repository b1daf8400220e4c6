"""The chart's alerts: every rule unit-tested by `promtool test rules` (tests/chart/alerts_test.yaml),
the PrometheusRule the chart renders is the plain rules file at the default thresholds, thresholds
come from values.yaml, and the operator's metrics that one alert reads are scraped."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from corral_cli.chartgen import alerts
from corral_cli.chartgen.files import ALERT_RULES
from corral_operator import telemetry

from tests.chart.conftest import ROOT, Helm, find

PROMTOOL_TESTS = Path(__file__).parent / "alerts_test.yaml"
MONITORING = tuple(
    f"--api-versions=monitoring.coreos.com/v1/{kind}" for kind in ("PodMonitor", "PrometheusRule")
)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (scripts/install-system.sh installs it)")
    return path


def test_rules_file_is_valid() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(ROOT / ALERT_RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts.alerts(alerts.default_thresholds()))} rules found" in result.stdout


def test_every_alert_passes_its_promtool_unit_tests() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", str(PROMTOOL_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_unit_test_and_a_runbook() -> None:
    tests = yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]
    firing = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    quiet = {c["alertname"] for t in tests for c in t["alert_rule_test"] if not c["exp_alerts"]}
    names = {a.name for a in alerts.alerts(alerts.default_thresholds())}
    assert firing == names and quiet == names
    runbook = (ROOT / "docs" / "operations.md").read_text()
    for name in names:
        assert f"### {name}\n" in runbook, name


def test_chart_rule_is_the_rules_file_at_default_thresholds(helm: Helm) -> None:
    (rule,) = find(helm.template(None, *MONITORING), "PrometheusRule")
    plain = yaml.safe_load((ROOT / ALERT_RULES).read_text())
    assert rule["spec"] == plain
    assert rule["metadata"]["labels"]["app.kubernetes.io/component"] == "alerts"


def test_thresholds_and_labels_come_from_values(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        "alerts:\n  ttftP99SloSeconds: 0.5\n  kvUsageRatio: 0.75\n"
        "  labels: {release: kube-prometheus-stack}\n"
    )
    objects = helm.template(values, *MONITORING)
    (rule,) = find(objects, "PrometheusRule")
    exprs = {r["alert"]: r["expr"] for r in rule["spec"]["groups"][0]["rules"]}
    assert exprs["CorralTTFTHigh"].endswith("> 0.5")
    assert exprs["CorralKVCacheFull"].endswith("> 0.75")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not find(helm.template(None, *MONITORING, "--set", "alerts.enabled=false"), "PrometheusRule")
    assert not find(helm.template(None), "PrometheusRule")  # no Prometheus Operator, no rule


def test_operator_serves_its_metrics_and_is_scraped(helm: Helm) -> None:
    objects = helm.template(None, *MONITORING)
    (deployment,) = find(objects, "Deployment", "operator")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=8081" in container["args"]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    (monitor,) = find(objects, "PodMonitor", "operator")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # The alert reads the operator's own counter by its declared name.
    exprs = [a.expr for a in alerts.alerts(alerts.default_thresholds())]
    assert any(telemetry.RECONCILE_ERRORS_TOTAL in e for e in exprs)
