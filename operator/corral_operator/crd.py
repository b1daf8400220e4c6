"""Generate the LLMDeployment CustomResourceDefinition from the pydantic spec model.

`python -m corral_operator.crd > crds/corral.dev_llmdeployments.yaml` regenerates the committed file;
a unit test checks it is current. The JSON schema pydantic emits is rewritten into a Kubernetes
structural schema: refs inlined, optionals collapsed, int-or-string marked, titles dropped.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

import yaml

from corral_operator import spec
from corral_operator.spec_base import SpecModel
from corral_operator.status_schema import LLMDeploymentStatus

CRD_NAME = f"{spec.PLURAL}.{spec.GROUP}"
CRD_PATH = "crds/corral.dev_llmdeployments.yaml"
_DROP_KEYS = {"title"}
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MESSAGE = (
    "metadata.name must be a DNS label (a-z, 0-9, '-', starting with a letter, at most 63 characters):"
    " it names the Deployment and the Service"
)
NAME_RULE = spec.cel(
    f"self.metadata.name.matches('{NAME_PATTERN}') && self.metadata.name.size() <= 63", NAME_MESSAGE
)

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.kind"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Up", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready replicas"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "KV%", "type": "integer", "jsonPath": ".status.load.kvUsagePercent"},
    {"name": "Waiting", "type": "integer", "jsonPath": ".status.load.numRequestsWaiting"},
    {"name": "URL", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "TP", "type": "integer", "jsonPath": ".status.tensorParallelSize", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Rewrite one pydantic JSON-schema node into its structural OpenAPI v3 form."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    is_collapsed = False  # an optional's branch, already rewritten (nested defaults included)
    rewritten: set[str] = set()  # keys that came from that branch: rewriting them twice would
    # read their optional children (anyOf gone) as required ones and give them `default: {}`
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])  # no YAML anchors for shared parts
        node = {**target, **node}
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if node.get("default", 0) is None:
            del node["default"]
        if len(branches) == 1:
            branch = _structural(branches[0], defs)
            rewritten = set(branch) - set(node)
            node = {**branch, **node}
            is_collapsed = True
        elif {b.get("type") for b in branches} == {"integer", "string"}:
            node.pop("type", None)
            node["x-kubernetes-int-or-string"] = True
        else:
            raise ValueError(f"cannot express anyOf {branches} in a structural schema")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key in rewritten:
            out[key] = value
            continue
        if key == "additionalProperties":
            if value is False or value is True:
                continue  # unknown fields are pruned by the API server; open objects say so below
            out[key] = _structural(value, defs)
        elif key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        elif key == "const":  # a one-value Literal; OpenAPI v3.0 (and so Kubernetes) has no const
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020: `exclusiveMinimum: 0`; OpenAPI 3.0: `minimum: 0, exclusiveMinimum: true`
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if out.get("type") == "object" and node.get("additionalProperties") is True and "properties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if not is_collapsed:
        _default_nested_objects(out, node)
    return _ordered(out)


_FIRST_KEYS = ("type", "description", "default", "enum")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Readable YAML: type and description first, nested properties last."""
    last = ("required", "properties", "additionalProperties", "items")
    head = {k: node[k] for k in _FIRST_KEYS if k in node}
    middle = {k: v for k, v in node.items() if k not in head and k not in last}
    return {**head, **middle, **{k: node[k] for k in last if k in node}}


def _default_nested_objects(out: dict[str, Any], node: dict[str, Any]) -> None:
    """Give non-optional nested objects `default: {}` so the API server fills their own defaults."""
    required = set(node.get("required", ()))
    for name, prop in out.get("properties", {}).items():
        if (
            name not in required
            and prop.get("type") == "object"
            and "properties" in prop
            and "default" not in prop
            and not _is_optional(node["properties"][name])
        ):
            prop["default"] = {}


def _is_optional(prop: dict[str, Any]) -> bool:
    return any(b.get("type") == "null" for b in prop.get("anyOf", ()))


def openapi_schema(model: type[SpecModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    schema = _structural(raw, defs)
    schema.pop("default", None)
    return schema


def build_crd() -> dict[str, Any]:
    spec_schema = openapi_schema(spec.LLMDeploymentSpec)
    spec_schema["description"] = (
        "Desired state: which model, which engine, how many replicas and how to scale."
    )
    status_schema = openapi_schema(LLMDeploymentStatus)
    status_schema["description"] = "Observed state, written by the operator."
    root = {
        "type": "object",
        "description": "An LLM served by a fleet of engine replicas behind one Service.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _ordered(spec_schema),
            "status": _ordered(status_schema),
        },
        "x-kubernetes-validations": [NAME_RULE],
    }
    version = {
        "name": spec.VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": root},
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        "additionalPrinterColumns": PRINTER_COLUMNS,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": spec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": list(spec.SHORT_NAMES),
                "categories": ["corral"],
            },
            "versions": [version],
        },
    }


@functools.cache
def expected_schema() -> dict[str, Any]:
    """This operator's LLMDeployment schema (what `crd_drift` compares the served one with)."""
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


HEADER = "# GENERATED by `python -m corral_operator.crd` from corral_operator/spec.py. Do not edit.\n"


def render_yaml() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main() -> int:
    sys.stdout.write(render_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
