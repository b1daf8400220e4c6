"""The operator's and gateway's pods: labels that keep matching their selectors, overridable security
contexts (OpenShift), spreading, priority and extra environment variables."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.chart.conftest import CHART, KUBERNETES_VERSION, Helm, find

COMPONENTS = ("operator", "gateway")
RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component (and "test") -> pod spec, of the Deployments and the helm-test Pod."""
    specs = {c: find(objects, "Deployment", c)[0]["spec"]["template"]["spec"] for c in COMPONENTS}
    (test_pod,) = find(objects, "Pod", "gateway-test")
    return {**specs, "test": test_pod["spec"]}


def test_pod_labels_cannot_replace_the_selector_labels(helm: Helm) -> None:
    extra = {"app.kubernetes.io/component": "api", "app.kubernetes.io/instance": "other", "team": "ml"}
    objects = helm.render({c: {"podLabels": extra} for c in COMPONENTS})
    for component in COMPONENTS:
        (deployment,) = find(objects, "Deployment", component)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        # A pod template the selector doesn't match is refused by the API server.
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert labels["team"] == "ml" and labels["app.kubernetes.io/component"] == component
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    (service,) = find(objects, "Service", "gateway")
    (gateway,) = find(objects, "Deployment", "gateway")
    assert service["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()


def test_security_contexts_default_to_the_restricted_profile(helm: Helm) -> None:
    for spec in _pod_specs(helm.template(None)).values():
        assert spec["securityContext"] == RESTRICTED_POD
        (container,) = spec["containers"]
        assert container["securityContext"] == RESTRICTED_CONTAINER


def test_openshift_profile_leaves_the_ids_to_the_scc(helm: Helm) -> None:
    """restricted-v2 refuses a fixed UID outside the namespace's range: the profile nulls them."""
    objects = helm.template(CHART / "ci" / "openshift-values.yaml")
    for spec in _pod_specs(objects).values():
        context = spec["securityContext"]
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & context.keys(), context
        assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = spec["containers"]
        assert container["securityContext"] == RESTRICTED_CONTAINER


def test_security_contexts_take_overrides_per_component(helm: Helm) -> None:
    values = {
        "operator": {"podSecurityContext": {"fsGroupChangePolicy": "OnRootMismatch", "fsGroup": None}},
        "gateway": {
            "containerSecurityContext": {
                "runAsUser": 2000,
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
            }
        },
    }
    objects = helm.render(values)
    specs = _pod_specs(objects)
    assert specs["operator"]["securityContext"] == {
        **{k: v for k, v in RESTRICTED_POD.items() if k != "fsGroup"},
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    gateway_context = {**RESTRICTED_CONTAINER, **values["gateway"]["containerSecurityContext"]}
    # The helm-test pod runs the gateway's image, with the gateway's contexts.
    for component in ("gateway", "test"):
        assert specs[component]["containers"][0]["securityContext"] == gateway_context
    assert specs["operator"]["containers"][0]["securityContext"] == RESTRICTED_CONTAINER
    for deployment in find(objects, "Deployment"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_spread_constraints_and_priority_class(helm: Helm) -> None:
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    own_selector = {"matchLabels": {"app": "mine"}}
    host = {**zone, "topologyKey": "kubernetes.io/hostname", "labelSelector": own_selector}
    values = {
        c: {"topologySpreadConstraints": [zone, host], "priorityClassName": f"corral-{c}"} for c in COMPONENTS
    }
    objects = helm.render(values)
    for component in COMPONENTS:
        (deployment,) = find(objects, "Deployment", component)
        spec = deployment["spec"]["template"]["spec"]
        assert spec["priorityClassName"] == f"corral-{component}"
        by_zone, by_host = spec["topologySpreadConstraints"]
        # Without a labelSelector a constraint would count no pods: the chart selects the component's.
        selector = deployment["spec"]["selector"]
        assert by_zone == {**zone, "labelSelector": {"matchLabels": selector["matchLabels"]}}
        assert by_host == host
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    for deployment in find(helm.template(None), "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert "priorityClassName" not in spec and "topologySpreadConstraints" not in spec


def test_extra_env_reaches_both_components_with_value_from(helm: Helm) -> None:
    env = [
        {"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"},
        {
            "name": "OTEL_EXPORTER_OTLP_HEADERS",
            "valueFrom": {"secretKeyRef": {"name": "otel", "key": "headers"}},
        },
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    objects = helm.render({c: {"extraEnv": env} for c in COMPONENTS})
    for component in COMPONENTS:
        (deployment,) = find(objects, "Deployment", component)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["env"] == (OPERATOR_ENV if component == "operator" else []) + env
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    (operator,) = find(helm.template(None), "Deployment", "operator")
    assert operator["spec"]["template"]["spec"]["containers"][0]["env"] == OPERATOR_ENV


# kopf names a peer by this variable when it is set (kopf._core.engines.peering.detect_own_id).
OPERATOR_ENV = [{"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]


def test_kopf_names_each_operator_peer_after_its_pod(helm: Helm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peering records (`kubectl get clusterkopfpeering -o yaml`) read as pod names, and a restarted
    container keeps its identity (its new record replaces its dead one)."""
    from kopf._core.engines.peering import detect_own_id

    (operator,) = find(helm.template(None), "Deployment", "operator")
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    (pod_id,) = [e for e in container["env"] if e["valueFrom"] == OPERATOR_ENV[0]["valueFrom"]]
    monkeypatch.setenv(pod_id["name"], "corral-operator-7d9f-abcde")
    assert detect_own_id(manual=False) == "corral-operator-7d9f-abcde"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("gateway.podSecurityContext.runAsUsr=1", "additional properties 'runAsUsr' not allowed"),
        ("operator.containerSecurityContext.runAsUser=-1",
         "at '/operator/containerSecurityContext/runAsUser'"),
        ("gateway.podSecurityContext.seccompProfile.type=Default",
         "at '/gateway/podSecurityContext/seccompProfile"),
        ("operator.extraEnv[0].name=A,operator.extraEnv[0].valeu=b",
         "additional properties 'valeu' not allowed"),
        ("operator.extraEnv[0].name=A,operator.extraEnv[0].valueFrom.secretRef.name=b",
         "additional properties 'secretRef' not allowed"),
        ("gateway.topologySpreadConstraints[0].maxSkew=1", "missing properties"),
        ("operator.priorityClass=high", "additional properties 'priorityClass' not allowed"),
    ],
)  # fmt: skip
def test_bad_pod_values_fail_with_the_key(helm: Helm, flag: str, message: str) -> None:
    result = helm.run("template", "corral", str(CHART), "--set", flag, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_a_stopping_gateway_keeps_serving_until_it_is_out_of_rotation(helm: Helm) -> None:
    """Endpoints drop a terminating pod at once, kube-proxy and load balancers later: without a
    preStop pause a rolling update's clients were refused by the stopping pod."""
    (deployment,) = find(helm.template(None), "Deployment", "gateway")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert spec["terminationGracePeriodSeconds"] == 60
    kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    (off,) = find(helm.render({"gateway": {"preStopSleepSeconds": 0}}), "Deployment", "gateway")
    assert "lifecycle" not in off["spec"]["template"]["spec"]["containers"][0]
    with pytest.raises(AssertionError, match="drainTimeoutSeconds must be below"):
        helm.render({"gateway": {"preStopSleepSeconds": 30, "terminationGracePeriodSeconds": 30}})


def test_a_stopping_gateway_ends_open_requests_cleanly_before_its_pod_is_killed(helm: Helm) -> None:
    """The gateway's own drain ends what is still open with a `draining` error before SIGKILL
    would cut it: preStop sleep + drain below the grace period, checked when rendering."""
    (config_map,) = find(helm.template(None), "ConfigMap", "gateway")
    assert yaml.safe_load(config_map["data"]["gateway.yaml"])["drain_timeout_s"] == 50
    values = {"gateway": {"drainTimeoutSeconds": 300, "terminationGracePeriodSeconds": 310}}
    (config_map,) = find(helm.render(values), "ConfigMap", "gateway")
    assert yaml.safe_load(config_map["data"]["gateway.yaml"])["drain_timeout_s"] == 300
    with pytest.raises(AssertionError, match="drainTimeoutSeconds must be below"):
        helm.render({"gateway": {"drainTimeoutSeconds": 55}})  # 5 + 55 is not below 60
    with pytest.raises(AssertionError, match="drain_timeout_s"):  # the chart's to set, not config's
        helm.render({"gateway": {"config": {"drain_timeout_s": 10}}})
