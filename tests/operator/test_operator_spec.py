"""Spec validation, and the generated CRD and RBAC files being current."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from corral_operator import crd, rbac
from corral_operator.spec import LLMDeploymentSpec, SpecError, parse_spec

from tests.operator.invalid_cases import INVALID_SPECS, valid_spec

ROOT = Path(__file__).resolve().parents[2]


def test_valid_spec_gets_defaults() -> None:
    spec = parse_spec(valid_spec())
    assert spec.engine.kind == "corral"
    assert spec.engine.port == 8000
    assert spec.resources.memory == "4Gi"
    assert spec.rollout.max_surge == 1 and spec.rollout.max_unavailable == 0
    assert spec.autoscaling is None


@pytest.mark.parametrize(("case", "raw", "message"), INVALID_SPECS, ids=[c[0] for c in INVALID_SPECS])
def test_invalid_spec_is_rejected_with_a_clear_message(case: str, raw: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    assert message in str(info.value), f"{case}: {info.value}"
    assert str(info.value).startswith("spec.")


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["kind"] == "LLMDeployment"
        LLMDeploymentSpec.model_validate(doc["spec"])


def test_committed_crd_is_current() -> None:
    committed = (ROOT / crd.CRD_PATH).read_text()
    assert committed == crd.render_yaml(), "run: python -m corral_operator.crd > " + crd.CRD_PATH


def test_committed_rbac_is_current() -> None:
    committed = (ROOT / rbac.RBAC_PATH).read_text()
    assert committed == rbac.render_yaml(), "run: python -m corral_operator.rbac > " + rbac.RBAC_PATH


def test_crd_has_scale_status_and_printer_columns() -> None:
    doc = crd.build_crd()
    assert doc["spec"]["names"]["shortNames"] == ["llmd"]
    assert doc["spec"]["scope"] == "Namespaced"
    version = doc["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Model", "Engine", "Ready", "Up", "Replicas", "KV%", "Waiting", "URL", "TP", "Age"]


def _walk(node: object):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_crd_schema_is_structural() -> None:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node and "const" not in node
        assert node.get("additionalProperties") is not False
    spec_props = schema["properties"]["spec"]["properties"]
    assert spec_props["engine"]["properties"]["kind"]["enum"] == ["corral", "vllm"]
    assert spec_props["rollout"]["properties"]["maxSurge"]["x-kubernetes-int-or-string"] is True
    assert spec_props["resources"]["default"] == {}
    rules = [r["rule"] for n in _walk(schema) for r in n.get("x-kubernetes-validations", [])]
    assert "self.minReplicas <= self.maxReplicas" in rules
    assert any("1024" in r for r in rules)


def test_rbac_grants_no_secrets_and_no_wildcards() -> None:
    for _, rule in rbac.RULES:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "secrets" not in rule["resources"]


def test_namespaced_role_drops_cluster_scoped_rules() -> None:
    role = rbac.namespaced_role("ml")
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "ml"
    groups = {g for rule in role["rules"] for g in rule["apiGroups"]}
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert "clusterkopfpeerings" not in resources
    assert len(role["rules"]) == len(rbac.RULES) - 1
    # nor does the cluster-wide operator read CRDs: API discovery says which optional kinds exist
    assert not [r for _, r in rbac.RULES if "apiextensions.k8s.io" in r["apiGroups"]]
    assert "apiextensions.k8s.io" not in groups


def test_optional_objects_get_no_schema_default_however_deep() -> None:
    """An optional object is left out, not defaulted to {}: under affinity an empty labelSelector or
    namespaceSelector the API server filled in would match every pod or every namespace."""
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    affinity = schema["properties"]["spec"]["properties"]["affinity"]

    def defaults(node: object, path: str) -> list[str]:
        if isinstance(node, dict):
            own = [path] if "default" in node else []
            return own + [p for k, v in node.items() for p in defaults(v, f"{path}/{k}")]
        if isinstance(node, list):
            return [p for i, v in enumerate(node) for p in defaults(v, f"{path}/{i}")]
        return []

    assert defaults(affinity, "affinity") == []
