"""The chart's `helm test` pod: a hook that runs `corral check` against the gateway's Service, with
valid flags, the restricted security context, and an API key from a Secret when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corral_cli.main import build_parser

from tests.chart.conftest import Helm, find


def gateway_test_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (pod,) = find(objects, "Pod", "gateway-test")
    return pod


def test_helm_test_pod_checks_the_gateway_service(helm: Helm) -> None:
    objects = helm.template(None)
    pod = gateway_test_pod(objects)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (service,) = find(objects, "Service", "gateway")
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["securityContext"]["runAsNonRoot"] is True
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    args = build_parser().parse_args(container["args"])
    assert args.command == "check"
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert args.base_url == f"http://{name}.{namespace}.svc:{service['spec']['ports'][0]['port']}"
    assert args.model is None and "env" not in container
    # The pod must not be one of the gateway's: the Service would send traffic to it.
    selector = service["spec"]["selector"]
    assert not selector.items() <= pod["metadata"]["labels"].items()


def test_helm_test_pod_with_a_model_and_an_api_key(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("tests:\n  model: tiny\n  apiKey: {existingSecret: corral-test-key}\n")
    (container,) = gateway_test_pod(helm.template(values))["spec"]["containers"]
    assert build_parser().parse_args(container["args"]).model == "tiny"
    assert container["env"] == [
        {
            "name": "CORRAL_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "corral-test-key", "key": "api-key"}},
        }
    ]


def test_helm_test_pod_can_be_left_out(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("tests:\n  enabled: false\n")
    assert not find(helm.template(values), "Pod")


def test_gateway_extra_env_reaches_its_container(helm: Helm, tmp_path: Path) -> None:
    """How the gateway's pods get OTEL_* variables (docs/operations.md, Traces)."""
    values = tmp_path / "values.yaml"
    endpoint = {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://collector:4318"}
    values.write_text(f"gateway:\n  extraEnv: [{{name: {endpoint['name']}, value: '{endpoint['value']}'}}]\n")
    (deployment,) = find(helm.template(values), "Deployment", "gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["env"] == [endpoint]
    (default,) = find(helm.template(None), "Deployment", "gateway")
    assert "env" not in default["spec"]["template"]["spec"]["containers"][0]


def test_helm_test_pod_schedules_where_the_gateway_does(helm: Helm, tmp_path: Path) -> None:
    """On a cluster whose every node is tainted or labelled-only, a test pod without the gateway's
    node selection stays Pending and `helm test` times out."""
    values = tmp_path / "values.yaml"
    values.write_text(
        "gateway:\n  nodeSelector: {pool: system}\n"
        "  tolerations: [{key: dedicated, operator: Equal, value: system, effect: NoSchedule}]\n"
    )
    spec = gateway_test_pod(helm.template(values))["spec"]
    assert spec["nodeSelector"] == {"pool": "system"}
    assert spec["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}
    ]
    default = gateway_test_pod(helm.template(None))["spec"]
    assert "nodeSelector" not in default and "tolerations" not in default


def test_helm_test_pod_resources_come_from_values(helm: Helm, tmp_path: Path) -> None:
    """A namespace whose LimitRange or ResourceQuota asks for CPU limits refuses a pod without one."""
    resources = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "200m", "memory": "64Mi"}}
    (container,) = gateway_test_pod(helm.render({"tests": {"resources": resources}}))["spec"]["containers"]
    assert container["resources"] == resources
    (default,) = gateway_test_pod(helm.template(None))["spec"]["containers"]
    assert default["resources"] == {
        "requests": {"cpu": "10m", "memory": "32Mi"},
        "limits": {"memory": "128Mi"},
    }
