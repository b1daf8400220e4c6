"""Whether the LLMDeployment CRD the API server serves is older or newer than this operator's (pure).

Helm never upgrades a chart's CRDs, and an older structural schema silently prunes the spec and
status fields it lacks. A newer one (its CRDs applied before `helm upgrade`, or the operator rolled
back) gives the operator spec fields it does not know, often through a schema default, so they
reach every LLMDeployment. The served schema (the API server's OpenAPI v3, readable by every
authenticated user, so a namespaced operator can check too) is compared field by field with the
one `python -m corral_operator.crd` generates.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

CHECKED = ("spec", "status")  # metadata, apiVersion and kind are the API server's own
MAX_LISTED = 5
FIX = (
    "kubectl apply --server-side -f charts/corral/crds/ (helm upgrade never changes CRDs; "
    'docs/operations.md, "Upgrading")'
)


def missing_fields(expected: Mapping[str, Any], served: Mapping[str, Any]) -> list[str]:
    """Paths (`status.rolledOutRevision`, `spec.tolerations[].key`) of the fields `expected`
    declares and `served` does not, under spec and status; a served open object keeps everything."""
    out: list[str] = []
    for name in CHECKED:
        want = (expected.get("properties") or {}).get(name)
        if want is not None:
            _walk(want, (served.get("properties") or {}).get(name), name, out)
    return out


def _walk(want: Mapping[str, Any], have: Mapping[str, Any] | None, path: str, out: list[str]) -> None:
    if have is None:
        out.append(path)
        return
    if have.get("x-kubernetes-preserve-unknown-fields"):
        return
    have_props = have.get("properties") or {}
    for name, prop in (want.get("properties") or {}).items():
        _walk(prop, have_props.get(name), f"{path}.{name}", out)
    if isinstance(want.get("items"), Mapping):
        _walk(want["items"], have.get("items"), f"{path}[]", out)
    if isinstance(want.get("additionalProperties"), Mapping):
        _walk(want["additionalProperties"], have.get("additionalProperties"), f"{path}.*", out)


def undeclared_fields(value: Any, schema: Mapping[str, Any], path: str = "spec") -> list[str]:
    """Paths of the fields in `value` (an object's spec) that `schema` (its spec schema) does not
    declare, in `missing_fields`' form; one under an open object or map is declared."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out: list[str] = []
    if isinstance(value, Mapping):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name, child in value.items():
            if name in props:
                out += undeclared_fields(child, props[name], f"{path}.{name}")
            elif isinstance(extra, Mapping):
                out += undeclared_fields(child, extra, f"{path}.*")
            elif extra is not True:
                out.append(f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            out += undeclared_fields(item, schema["items"], f"{path}[]")
    return sorted(set(out))


def _listed(paths: list[str]) -> str:
    """The first MAX_LISTED paths, and how many more."""
    more = f" and {len(paths) - MAX_LISTED} more" if len(paths) > MAX_LISTED else ""
    return ", ".join(paths[:MAX_LISTED]) + more


def stale_message(missing: list[str]) -> str | None:
    """What users read (the operator's log, a Degraded condition); None when nothing is missing."""
    if not missing:
        return None
    listed = _listed(missing)
    return (
        f"the installed LLMDeployment CRD is older than this operator: it lacks {listed}, so the "
        f"API server drops those fields; apply this release's CRDs: {FIX}"
    )


def stale_status_fields(missing: list[str]) -> frozenset[str]:
    """Top-level status fields the served schema lacks: writing them would be pruned every time."""
    return frozenset(p.split(".", 1)[1] for p in missing if p.startswith("status.") and p.count(".") == 1)


def newer_message(unknown: list[str]) -> str | None:
    """What the operator logs when the served CRD has spec fields it does not know (it ignores them)."""
    if not unknown:
        return None
    listed = _listed(unknown)
    return (
        f"the installed LLMDeployment CRD is newer than this operator: it ignores {listed} "
        "until it is upgraded to the CRDs' release"
    )


def without_fields(spec: Mapping[str, Any], paths: list[str]) -> Mapping[str, Any]:
    """`spec` less the fields at `paths` (`spec.a.b`, `spec.xs[].k`, `spec.m.*.k`); `spec` itself
    when none is there, else a copy."""
    wanted = [p.split(".")[1:] for p in paths if p.startswith("spec.")]
    if not wanted:
        return spec
    out = copy.deepcopy(dict(spec))
    for parts in wanted:
        _drop(out, parts)
    return out


def _drop(node: Any, parts: list[str]) -> None:
    if not isinstance(node, dict) or not parts:
        return
    head, rest = parts[0], parts[1:]
    children: list[Any]
    if head == "*":
        children = list(node.values())
    elif head.endswith("[]"):
        items = node.get(head[:-2])
        children = items if isinstance(items, list) else []
    elif not rest:
        node.pop(head, None)
        return
    else:
        children = [node.get(head)]
    for child in children:
        _drop(child, rest)
