"""How clients reach the gateway: a fixed node port, an Ingress and a Gateway API HTTPRoute, each
pointing at the gateway's Service."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.chart.conftest import CHART, KUBERNETES_VERSION, Helm, find


def _service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = find(objects, "Service", "gateway")
    return service


@pytest.mark.parametrize("service_type", ["NodePort", "LoadBalancer"])
def test_node_port_is_fixed_when_asked(helm: Helm, service_type: str) -> None:
    objects = helm.render({"gateway": {"service": {"type": service_type, "nodePort": 30080}}})
    service = _service(objects)
    (port,) = service["spec"]["ports"]
    assert port["nodePort"] == 30080 and service["spec"]["type"] == service_type
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    (picked,) = _service(helm.render({"gateway": {"service": {"type": "NodePort"}}}))["spec"]["ports"]
    assert "nodePort" not in picked


def test_ingress_routes_its_hosts_to_the_gateway_service(helm: Helm) -> None:
    ingress_values = {
        "enabled": True,
        "className": "nginx",
        "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"},
        "hosts": [
            {"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]},
            {"host": "*.llm.example.com"},  # no paths: every path
        ],
        "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}],
    }
    objects = helm.render({"gateway": {"ingress": ingress_values}})
    (ingress,) = find(objects, "Ingress", "gateway")
    kubernetes_validate.validate(ingress, KUBERNETES_VERSION, strict=True)
    spec, service = ingress["spec"], _service(objects)
    assert spec["ingressClassName"] == "nginx" and spec["tls"] == ingress_values["tls"]
    assert ingress["metadata"]["annotations"] == ingress_values["annotations"]
    assert [rule["host"] for rule in spec["rules"]] == ["llm.example.com", "*.llm.example.com"]
    paths = [(p["path"], p["pathType"]) for rule in spec["rules"] for p in rule["http"]["paths"]]
    assert paths == [("/v1", "Prefix"), ("/", "Prefix")]
    (service_port,) = service["spec"]["ports"]
    for rule in spec["rules"]:
        for path in rule["http"]["paths"]:
            assert path["backend"]["service"] == {
                "name": service["metadata"]["name"],
                "port": {"name": service_port["name"]},
            }


def test_ingress_without_hosts_takes_every_host(helm: Helm) -> None:
    (ingress,) = find(helm.render({"gateway": {"ingress": {"enabled": True}}}), "Ingress")
    kubernetes_validate.validate(ingress, KUBERNETES_VERSION, strict=True)
    (rule,) = ingress["spec"]["rules"]
    assert "host" not in rule and [p["path"] for p in rule["http"]["paths"]] == ["/"]
    assert "ingressClassName" not in ingress["spec"]


def test_http_route_attaches_the_gateway_service_to_a_gateway(helm: Helm) -> None:
    route_values = {
        "enabled": True,
        "parentRefs": [{"name": "public", "namespace": "gateways", "sectionName": "https"}],
        "hostnames": ["llm.example.com"],
        "annotations": {"team": "ml"},
        "timeouts": {"request": "3600s", "backendRequest": "1h"},
    }
    objects = helm.render({"gateway": {"httpRoute": route_values, "service": {"port": 8080}}})
    (route,) = find(objects, "HTTPRoute", "gateway")
    # No schema ships for Gateway API kinds (a CRD): check its shape against the v1 API here.
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["namespace"] == "corral-system"
    assert route["metadata"]["annotations"] == {"team": "ml"}
    spec = route["spec"]
    assert set(spec) == {"parentRefs", "hostnames", "rules"}
    assert spec["parentRefs"] == route_values["parentRefs"] and spec["hostnames"] == ["llm.example.com"]
    (rule,) = spec["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["timeouts"] == route_values["timeouts"]
    service = _service(objects)
    (port,) = service["spec"]["ports"]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": port["port"]}]


def test_exposure_is_off_by_default(helm: Helm) -> None:
    objects = helm.template(None)
    assert not find(objects, "Ingress") and not find(objects, "HTTPRoute")
    assert "nodePort" not in _service(objects)["spec"]["ports"][0]
    route = helm.render({"gateway": {"httpRoute": {"enabled": True, "parentRefs": [{"name": "public"}]}}})
    (rule,) = find(route, "HTTPRoute")[0]["spec"]["rules"]
    assert "timeouts" not in rule  # the implementation's own unless set


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("gateway.service.nodePort=30080", "nodePort needs gateway.service.type NodePort or LoadBalancer"),
        ("gateway.service.type=NodePort,gateway.service.nodePort=70000", "at '/gateway/service/nodePort'"),
        ("gateway.ingress.enabeld=true", "additional properties 'enabeld' not allowed"),
        ("gateway.ingress.hosts[0].host=a,gateway.ingress.hosts[0].paths[0].pathType=Glob",
         "at '/gateway/ingress/hosts/0/paths/0/pathType'"),
        ("gateway.ingress.tls[0].secret=x", "additional properties 'secret' not allowed"),
        ("gateway.httpRoute.enabled=true", "gateway.httpRoute.parentRefs must name the Gateway"),
        ("gateway.httpRoute.parentRefs[0].nme=x", "missing property 'name'"),
        ("gateway.httpRoute.timeouts.request=forever", "at '/gateway/httpRoute/timeouts/request'"),
    ],
)  # fmt: skip
def test_bad_exposure_values_fail_with_the_key(helm: Helm, flag: str, message: str) -> None:
    result = helm.run("template", "corral", str(CHART), "--set", flag, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
