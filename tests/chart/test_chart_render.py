"""The Helm chart: lint, Kubernetes schemas for several values profiles, values schema, and agreement
with the operator's RBAC, CRDs, labels and CLI flags."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from corral_cli.chartgen.files import stale_files
from corral_cli.chartgen.values import Values
from corral_cli.cmd_operator import settings_from_args
from corral_cli.main import build_parser
from corral_gateway.settings import GatewaySettings
from corral_operator import labels, rbac

from tests.chart.conftest import CHART, KUBERNETES_VERSION, PROFILES, ROOT, Helm, find

Render = Callable[[str], list[dict[str, Any]]]
# Custom resources: checked against their CRD's schema in the chart, or by the test below.
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def test_generated_files_are_current() -> None:
    assert stale_files(ROOT) == [], "run: python -m corral_cli.chartgen"


def test_helm_lint_strict_is_clean(helm: Helm) -> None:
    for values_file in PROFILES.values():
        extra = ["--values", str(values_file)] if values_file else []
        result = helm.run("lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in result.stdout
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema, for every CRD the chart ships."""
    out = {}
    for path in (CHART / "crds").glob("*.yaml"):
        for crd in yaml.safe_load_all(path.read_text()):
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                out[key] = version["schema"]["openAPIV3Schema"]
    return out


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_rendered_objects_match_kubernetes_schemas(rendered: Render, profile: str) -> None:
    crds = _crd_schemas()
    objects = rendered(profile)
    assert objects
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in crds:
            jsonschema.validate(obj, crds[key])
        elif obj["kind"] in MONITORING_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        else:
            # strict: unknown fields (a mis-indented key) are errors, not silently dropped
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_rendered_crds_match_kubernetes_schemas(helm: Helm) -> None:
    objects = helm.template(None, "--include-crds")
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert {c["metadata"]["name"] for c in crds} == {
        "llmdeployments.corral.dev",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }
    for crd in crds:
        kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)


def test_chart_crds_are_the_repository_crds() -> None:
    repo = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert chart == repo


def _rule_key(rule: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(tuple(rule.get(k) or ()) for k in ("apiGroups", "resources", "resourceNames", "verbs"))


def test_operator_cluster_role_is_the_operators_rbac(rendered: Render) -> None:
    (role,) = find(rendered("default"), "ClusterRole", "operator")
    assert [_rule_key(r) for r in role["rules"]] == [_rule_key(r) for _, r in rbac.RULES]
    (binding,) = find(rendered("default"), "ClusterRoleBinding", "operator")
    (account,) = find(rendered("default"), "ServiceAccount", "operator")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "corral-system"}
    ]


def test_namespaced_operator_gets_roles_without_cluster_scoped_rules(rendered: Render) -> None:
    objects = rendered("production")
    assert not find(objects, "ClusterRole", "operator") and not find(
        objects, "ClusterRoleBinding", "operator"
    )
    roles = find(objects, "Role", "operator")
    bindings = find(objects, "RoleBinding", "operator")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    namespaced = rbac.namespaced_role("team-a")["rules"]
    assert len(namespaced) < len(rbac.RULES)
    for role in roles:
        assert [_rule_key(r) for r in role["rules"]] == [_rule_key(r) for r in namespaced]
    for binding in bindings:
        assert binding["subjects"][0]["namespace"] == "corral-system"


def test_default_install_names_the_identity_the_e2e_cluster_knows(rendered: Render) -> None:
    """Release `corral` in corral-system runs as system:serviceaccount:corral-system:corral-operator."""
    (deployment,) = find(rendered("default"), "Deployment", "operator")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == rbac.NAME
    assert deployment["metadata"]["namespace"] == rbac.NAMESPACE


@pytest.mark.parametrize(
    ("profile", "kind", "resource"),
    [("default", "ClusterRole", "endpointslices"), ("production", "Role", "pods")],
)
def test_gateway_may_only_read_what_its_discovery_watches(
    rendered: Render, profile: str, kind: str, resource: str
) -> None:
    roles = find(rendered(profile), kind, "gateway")
    assert roles
    for role in roles:
        assert [r["resources"] for r in role["rules"]] == [[resource], ["llmdeployments"]]
        discovery, deployments = role["rules"]
        assert set(discovery["verbs"]) == {"get", "list", "watch"}
        # names and aliases come from the LLMDeployments; patch only sets the wake annotation
        assert deployments["apiGroups"] == ["corral.dev"]
        assert set(deployments["verbs"]) == {"get", "list", "watch", "patch"}


def _gateway_scope(objects: list[dict[str, Any]]) -> tuple[list[str], tuple[str, ...]]:
    """(namespaces of the gateway's Roles, each bound to its account; the namespaces its settings watch),
    after checking that a Role and a ClusterRole never come together."""
    roles, bindings = find(objects, "Role", "gateway"), find(objects, "RoleBinding", "gateway")
    cluster_roles = find(objects, "ClusterRole", "gateway") + find(objects, "ClusterRoleBinding", "gateway")
    assert not (roles and cluster_roles) and (roles or len(cluster_roles) == 2)
    (account,) = find(objects, "ServiceAccount", "gateway")
    subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "corral-system"}
    assert [b["metadata"]["namespace"] for b in bindings] == [r["metadata"]["namespace"] for r in roles]
    assert all(b["subjects"] == [subject] for b in bindings)
    (config_map,) = find(objects, "ConfigMap", "gateway")
    settings = GatewaySettings(**yaml.safe_load(config_map["data"]["gateway.yaml"]))
    return [r["metadata"]["namespace"] for r in roles], settings.kubernetes.namespaces


@pytest.mark.parametrize(
    ("values", "namespaces"),
    [
        ([], []),  # every namespace: a ClusterRole
        # a namespaced operator: the gateway follows it, a Role in each of its namespaces
        (["operator.namespaces={team-a,team-b}"], ["team-a", "team-b"]),
        (["operator.namespaces={team-a,team-b}", "gateway.discovery.namespaces={team-c}"], ["team-c"]),
        (["gateway.discovery.namespaces={team-a,team-b}"], ["team-a", "team-b"]),
        # the older one-namespace key still works, and wins over the operator's list
        (["gateway.discovery.namespace=team-a"], ["team-a"]),
        (["operator.namespaces={team-a,team-b}", "gateway.discovery.namespace=team-a"], ["team-a"]),
    ],
)
def test_gateway_watches_and_may_read_the_namespaces_it_is_given(
    helm: Helm, values: list[str], namespaces: list[str]
) -> None:
    objects = helm.template(None, *[arg for value in values for arg in ("--set", value)])
    assert _gateway_scope(objects) == (namespaces, tuple(namespaces))


def test_production_profile_routes_every_namespace_the_operator_serves(rendered: Render) -> None:
    # was gateway.discovery.namespace: team-a beside operator.namespaces [team-a, team-b]: team-b got 404
    assert _gateway_scope(rendered("production")) == (["team-a", "team-b"], ("team-a", "team-b"))


def test_gateway_refuses_both_namespace_keys(helm: Helm) -> None:
    args = ["--set", "gateway.discovery.namespace=a", "--set", "gateway.discovery.namespaces={b}"]
    result = helm.run("template", "corral", str(CHART), *args, check=False)
    assert result.returncode != 0
    assert "set only namespaces" in result.stderr, result.stderr


def test_notes_warn_when_the_gateway_misses_a_namespace_the_operator_serves(helm: Helm) -> None:
    def notes(*values: str) -> str:
        args = ["install", "corral", str(CHART), "--dry-run=client", "--namespace", "corral-system"]
        args += [arg for value in values for arg in ("--set", value)]
        return helm.run(*args).stdout.split("NOTES:", 1)[1]

    both = "operator.namespaces={team-a,team-b}"
    assert "in namespaces team-a, team-b)" in notes(both) and "WARNING" not in notes(both)
    missing = notes(both, "gateway.discovery.namespaces={team-a}")
    assert "serves namespace(s) team-b, which the gateway does not watch" in missing
    assert "in every namespace)" in notes()


def _args(deployment: dict[str, Any]) -> list[str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


@pytest.mark.parametrize("profile", ["default", "production"])
def test_container_args_are_valid_corral_flags(rendered: Render, profile: str) -> None:
    parser = build_parser()
    for component in ("operator", "gateway"):
        (deployment,) = find(rendered(profile), "Deployment", component)
        args = parser.parse_args(_args(deployment))
        assert isinstance(args, argparse.Namespace) and args.command == component


def test_operator_serves_the_configured_namespaces_with_peering(rendered: Render) -> None:
    objects = rendered("production")
    (deployment,) = find(objects, "Deployment", "operator")
    args = build_parser().parse_args(_args(deployment))
    assert args.namespace == ["team-a", "team-b"] and args.peering == "corral-teams"
    peerings = find(objects, "KopfPeering", "corral-teams")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    (default_peering,) = find(rendered("default"), "ClusterKopfPeering")
    default_args = build_parser().parse_args(_args(find(rendered("default"), "Deployment", "operator")[0]))
    assert default_args.all_namespaces and default_args.peering == default_peering["metadata"]["name"]


@pytest.mark.parametrize("profile", ["default", "production"])
def test_gateway_config_is_valid_gateway_settings(rendered: Render, profile: str) -> None:
    (config_map,) = find(rendered(profile), "ConfigMap", "gateway")
    data = yaml.safe_load(config_map["data"]["gateway.yaml"])
    settings = GatewaySettings(**data)
    assert settings.kubernetes.enabled and settings.host == "0.0.0.0"
    if profile == "production":
        assert settings.policy == "kv-aware" and settings.max_queue_len == 512
        assert str(settings.api_keys_file) == "/etc/corral/api-keys/keys.yaml"
        assert settings.kubernetes.namespaces == ("team-a", "team-b")


def test_network_policy_selects_the_operators_engine_pods(rendered: Render) -> None:
    engine_pod_labels = labels.common("tiny", "tiny", "corral")
    for profile, namespaces in (("default", ["corral-system"]), ("production", ["team-a", "team-b"])):
        policies = find(rendered(profile), "NetworkPolicy", "engines")
        assert sorted(p["metadata"]["namespace"] for p in policies) == namespaces
        for policy in policies:
            wanted = policy["spec"]["podSelector"]["matchLabels"]
            assert wanted.items() <= engine_pod_labels.items()
            peers = policy["spec"]["ingress"][0]["from"]
            components = [p["podSelector"].get("matchLabels", {}).get(labels.COMPONENT) for p in peers]
            assert components == ["gateway", "operator", None]  # the third is Prometheus
            for peer, component in zip(peers[:2], ("gateway", "operator"), strict=True):
                (deployment,) = find(rendered(profile), "Deployment", component)
                pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
                assert peer["podSelector"]["matchLabels"].items() <= pod_labels.items()
                ns_label = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                assert ns_label == deployment["metadata"]["namespace"]
    assert not find(rendered("operator-only"), "NetworkPolicy")


def test_monitors_only_when_the_crds_exist_or_asked_for(helm: Helm, rendered: Render) -> None:
    assert not find(rendered("default"), "ServiceMonitor")
    with_crd = helm.template(None, "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    (monitor,) = find(with_crd, "ServiceMonitor")
    (service,) = find(with_crd, "Service", "gateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert "authorization" not in monitor["spec"]["endpoints"][0]  # the gateway's /metrics is open
    keyed = helm.template(
        None,
        "--api-versions=monitoring.coreos.com/v1/ServiceMonitor",
        "--set=gateway.apiKeys.existingSecret=api-keys",
        "--set=gateway.config.metrics_require_auth=true",
        "--set=monitoring.gatewayApiKey.existingSecret=metrics-key",
    )
    (keyed_monitor,) = find(keyed, "ServiceMonitor")
    assert keyed_monitor["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "metrics-key", "key": "api-key"},
    }
    # a cluster serving ServiceMonitor alone gets no PodMonitor or PrometheusRule it would refuse
    assert not find(with_crd, "PodMonitor") and not find(with_crd, "PrometheusRule")
    every = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
    served = helm.template(None, *(f"--api-versions=monitoring.coreos.com/v1/{kind}" for kind in every))
    assert {o["kind"] for o in served} >= set(every)
    (engines,) = find(rendered("production"), "PodMonitor", "engines")
    # the label KEDA's triggers select an LLMDeployment's pods by (autoscalers.INSTANCE_SERIES_LABEL)
    assert engines["spec"]["podTargetLabels"] == [labels.INSTANCE]


def test_dashboards_are_labelled_configmaps(rendered: Render) -> None:
    maps = find(rendered("production"), "ConfigMap", "dashboard")
    assert len(maps) == len(list((CHART / "dashboards").glob("*.json"))) == 2
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == "monitoring"
        ((name, text),) = config_map["data"].items()
        assert text.strip() == (CHART / "dashboards" / name).read_text().strip()


def test_restricted_security_context(rendered: Render) -> None:
    for deployment in find(rendered("default"), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] and context["capabilities"]["drop"] == ["ALL"]


def test_values_yaml_is_the_schema_models_defaults() -> None:
    committed = yaml.safe_load((CHART / "values.yaml").read_text())
    assert Values().model_dump(by_alias=True) == committed
    for path in PROFILES.values():
        if path is not None:
            Values.model_validate({**committed, **yaml.safe_load(path.read_text())})


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("gateway.replicas=-1", "at '/gateway/replicas': minimum"),
        ("gateway.policy=fastest", "at '/gateway/policy': value must be one of"),
        ("gateway.polcy=kv-aware", "additional properties 'polcy' not allowed"),
        ("gateway.discovery.source=services", "at '/gateway/discovery/source'"),
        ("gateway.discovery.namespaces={Team_A}", "at '/gateway/discovery/namespaces/0'"),
        ("operator.replicas=0", "at '/operator/replicas': minimum"),
        ("operator.namespaces={Team_A}", "at '/operator/namespaces/0'"),
        ("networkPolicy.engineNamespaces={team a}", "at '/networkPolicy/engineNamespaces/0'"),
        ("operator.peering.name=Not_A_Name", "at '/operator/peering/name'"),
        ("monitoring.create=maybe", "at '/monitoring/create'"),
        ("monitoring.interval=soon", "at '/monitoring/interval'"),
        ("gateway.service.type=Magic", "at '/gateway/service/type'"),
        # gateway.config is checked against the gateway's own settings (it refuses unknown keys)
        ("gateway.config.max_queue_length=512", "additional properties 'max_queue_length' not allowed"),
        ("gateway.config.max_queue_len=-1", "at '/gateway/config/max_queue_len': minimum"),
        ("gateway.config.port=9000", "additional properties 'port' not allowed"),  # the chart's
        ("gateway.autoscaling.enabled=true,gateway.autoscaling.minReplicas=5,gateway.autoscaling.maxReplicas=2",
         "minReplicas must not exceed"),
    ],
)  # fmt: skip
def test_bad_values_fail_with_a_clear_message(helm: Helm, flag: str, message: str) -> None:
    result = helm.run("template", "corral", str(CHART), "--set", flag, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_notes_tell_how_to_create_a_deployment_and_call_the_gateway(helm: Helm) -> None:
    out = helm.run("install", "corral", str(CHART), "--dry-run=client", "-n", "corral-system").stdout
    notes = out.split("NOTES:", 1)[1]
    assert "kind: LLMDeployment" in notes and "/v1/chat/completions" in notes
    assert "svc/corral-gateway" in notes


def test_bad_values_file_is_refused_by_the_schema_model() -> None:
    with pytest.raises(ValueError, match="targetCpuUtilizationPercentage"):
        Values.model_validate({"gateway": {"autoscaling": {"targetCpuUtilizationPercentage": 0}}})


def test_gateway_disruption_budget_only_with_several_replicas(helm: Helm, rendered: Render) -> None:
    (budget,) = find(rendered("default"), "PodDisruptionBudget", "gateway")
    (deployment,) = find(rendered("default"), "Deployment", "gateway")
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # unready pods never block a drain
    assert not find(helm.template(None, "--set", "gateway.replicas=1"), "PodDisruptionBudget")


def test_the_chart_takes_an_umbrella_charts_global_values(helm: Helm) -> None:
    # Helm passes `global` to every subchart, so a schema refusing it refuses Corral as a dependency.
    assert find(helm.template(None, "--set", "global.imageRegistry=registry.example"), "Deployment")


def test_a_long_fullname_override_keeps_the_operator_and_gateway_apart(helm: Helm) -> None:
    long_name = "a-very-long-fullname-override-for-corral-platform-team-prod-eu1"  # 63 characters
    objects = helm.template(None, "--set", f"fullnameOverride={long_name}")
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), sorted(names)
    assert all(len(name) <= 63 for kind, name in names if kind == "Service")  # DNS labels


def test_notes_show_the_key_where_the_gateway_wants_one(helm: Helm) -> None:
    def notes(*values: str) -> str:
        args = ["install", "corral", str(CHART), "--dry-run=client", "--namespace", "corral-system", *values]
        return helm.run(*args).stdout.split("NOTES:", 1)[1]

    with_keys = notes("--set", "gateway.apiKeys.existingSecret=keys")
    assert 'curl http://127.0.0.1:8000/v1/models -H "Authorization: Bearer $API_KEY"' in with_keys
    assert "set tests.apiKey.existingSecret" in with_keys
    assert "curl http://127.0.0.1:8000/v1/models\n" in notes() and "tests.apiKey" not in notes()


def test_monitoring_labels_reach_the_operators_service_monitors(helm: Helm) -> None:
    objects = helm.template(None, "--set-json", 'monitoring.labels={"release":"kube-prometheus-stack"}')
    (operator,) = find(objects, "Deployment", "operator")
    assert "--monitor-label=release=kube-prometheus-stack" in _args(operator)


def test_monitoring_interval_reaches_the_operators_service_monitors(helm: Helm) -> None:
    """The engines' ServiceMonitors scrape as often as the chart's own monitors."""
    (operator,) = find(helm.template(None, "--set", "monitoring.interval=1m"), "Deployment", "operator")
    args = build_parser().parse_args(_args(operator))
    assert settings_from_args(args).monitor_interval == "1m"


def test_gateway_config_takes_the_gateways_own_settings(helm: Helm) -> None:
    objects = helm.template(None, "--set", "gateway.config.max_queue_len=512")
    (config_map,) = find(objects, "ConfigMap", "gateway")
    (text,) = config_map["data"].values()
    settings = yaml.safe_load(text)
    assert settings["max_queue_len"] == 512 and set(settings) <= set(GatewaySettings.model_fields)


def test_the_upstream_api_key_comes_from_a_secret_never_the_config_map(
    helm: Helm, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = helm.template(
        None,
        "--set", "gateway.upstreamApiKey.existingSecret=upstream",
        "--set", "gateway.extraEnv[0].name=A,gateway.extraEnv[0].value=b",
    )  # fmt: skip
    (gateway,) = find(objects, "Deployment", "gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    key = {
        "name": "CORRAL_GATEWAY_UPSTREAM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "upstream", "key": "api-key"}},
    }
    assert container["env"] == [key, {"name": "A", "value": "b"}]
    monkeypatch.setenv(key["name"], "sk-upstream")  # the variable is the gateway's own setting
    assert GatewaySettings().upstream_api_key == "sk-upstream"
    (default,) = find(helm.template(None), "Deployment", "gateway")
    assert "env" not in default["spec"]["template"]["spec"]["containers"][0]
    refused = helm.run(
        "template", "corral", str(CHART), "--set", "gateway.config.upstream_api_key=sk", check=False
    )
    assert refused.returncode != 0 and "'upstream_api_key' not allowed" in refused.stderr, refused.stderr


def test_network_policies_follow_a_namespaced_operator(helm: Helm) -> None:
    objects = helm.template(None, "--set", "operator.namespaces={team-a,team-b}")
    policies = find(objects, "NetworkPolicy", "engines")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
