"""Whether the served LLMDeployment CRD is older than the operator's (crd_drift, pure)."""

from __future__ import annotations

import copy
from typing import Any

from corral_operator import crd_drift
from corral_operator.crd import expected_schema


def older_crd() -> dict[str, Any]:
    """This release's schema less a status field and a nested spec field, as an older CRD would be."""
    served = copy.deepcopy(expected_schema())
    del served["properties"]["status"]["properties"]["rolledOutRevision"]
    del served["properties"]["spec"]["properties"]["rollout"]["properties"]["maxSurge"]
    return served


def test_the_current_crd_lacks_nothing() -> None:
    assert crd_drift.missing_fields(expected_schema(), copy.deepcopy(expected_schema())) == []
    assert crd_drift.stale_message([]) is None


def test_an_older_crd_names_the_fields_it_would_drop_and_the_fix() -> None:
    missing = crd_drift.missing_fields(expected_schema(), older_crd())
    assert missing == ["spec.rollout.maxSurge", "status.rolledOutRevision"]
    message = crd_drift.stale_message(missing) or ""
    assert "lacks spec.rollout.maxSurge, status.rolledOutRevision" in message
    assert "kubectl apply --server-side -f charts/corral/crds/" in message
    assert crd_drift.stale_status_fields(missing) == {"rolledOutRevision"}


def test_a_missing_object_is_one_field_and_a_long_list_is_cut() -> None:
    served = copy.deepcopy(expected_schema())
    del served["properties"]["status"]["properties"]["load"]
    assert crd_drift.missing_fields(expected_schema(), served) == ["status.load"]
    served["properties"]["status"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert crd_drift.missing_fields(expected_schema(), served) == []  # an open object keeps all
    message = crd_drift.stale_message([f"spec.f{i}" for i in range(8)]) or ""
    assert "spec.f4 and 3 more" in message and "spec.f5" not in message


def test_list_items_are_compared_too() -> None:
    want: dict[str, Any] = {
        "properties": {"spec": {"properties": {"xs": {"items": {"properties": {"k": {}}}}}}}
    }
    have: dict[str, Any] = {"properties": {"spec": {"properties": {"xs": {"items": {"properties": {}}}}}}}
    assert crd_drift.missing_fields(want, have) == ["spec.xs[].k"]


def newer_crd() -> dict[str, Any]:
    """This release's schema plus spec fields a later release adds (one inside tolerations' items)."""
    served = copy.deepcopy(expected_schema())
    spec = served["properties"]["spec"]["properties"]
    spec["newKnob"] = {"type": "object", "default": {}, "properties": {"level": {"type": "integer"}}}
    spec["tolerations"]["items"]["properties"]["newKey"] = {"type": "string"}
    return served


def test_a_newer_crds_spec_fields_are_named_and_dropped_before_parsing() -> None:
    unknown = crd_drift.missing_fields(newer_crd(), expected_schema())
    assert sorted(unknown) == ["spec.newKnob", "spec.tolerations[].newKey"]
    assert "newer than this operator: it ignores spec." in (crd_drift.newer_message(unknown) or "")
    spec = {"replicas": 1, "newKnob": {"level": 3}, "tolerations": [{"key": "gpu", "newKey": "x"}]}
    assert crd_drift.without_fields(spec, unknown) == {"replicas": 1, "tolerations": [{"key": "gpu"}]}
    assert spec["newKnob"] == {"level": 3}  # the body kopf holds is not changed
    assert crd_drift.without_fields(spec, []) is spec


def test_a_specs_fields_the_schema_does_not_declare_are_named_like_missing_fields() -> None:
    schema = expected_schema()["properties"]["spec"]
    spec = {"replicas": 1, "newKnob": {"level": 3}, "tolerations": [{"key": "gpu", "newKey": "x"}]}
    assert crd_drift.undeclared_fields(spec, schema) == ["spec.newKnob", "spec.tolerations[].newKey"]
    assert crd_drift.undeclared_fields({"replicas": 1}, schema) == []
    open_map = {"properties": {"labels": {"type": "object", "additionalProperties": {"type": "string"}}}}
    assert crd_drift.undeclared_fields({"labels": {"any": "x"}}, open_map) == []  # a map's keys are free
