"""Served names from LLMDeployments (pure): which names a client may ask for, and where each goes.

The rule: within the gateway's scope (the namespaces it watches, or every one), a served name
or alias used in one namespace is requested as is; deployments in one namespace that serve the same
name pool together. A name used in several namespaces is ambiguous: each deployment is then asked
for as `NAMESPACE/NAME`, and the bare name is refused with a message listing those. `NAMESPACE/NAME`
always works. An alias routes to its deployment's pool; the engine is sent the deployment's name.
A LoRA adapter a deployment declares (`spec.adapters`) is asked for by the same rule, and routes to
the deployment's pool under its own name; a model name or alias of that name wins (fleet.is_taken).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Served:
    """One LLMDeployment's names, and whether a request wakes it at zero replicas (its autoscaler
    scales from zero: the operator's builtin one on the wake annotation, or KEDA on the gateway's
    queue; an HPA does not, and a fixed `replicas: 0` means off)."""

    namespace: str
    deployment: str
    name: str
    aliases: tuple[str, ...] = ()
    can_wake: bool = True
    adapters: tuple[str, ...] = ()  # its `spec.adapters` names


@dataclass(frozen=True, slots=True)
class Route:
    key: str  # the registry's pool
    upstream: str  # the model name the engine serves (what the request body is sent with)
    adapter: str | None = None  # a LoRA adapter of the pool's model (then also `upstream`)


@dataclass(frozen=True, slots=True)
class Naming:
    routes: dict[str, Route] = field(default_factory=dict)  # every name a client may ask for
    ambiguous: dict[str, list[str]] = field(default_factory=dict)  # bare name -> qualified names
    keys: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, deployment) -> pool
    aliases: dict[str, str] = field(default_factory=dict)  # unqualified alias -> pool (for listing)
    # Declared adapters: every name a client may ask for one by (bare where declared in one namespace,
    # NAMESPACE/NAME always) -> a route per pool declaring it there (several: refused as ambiguous).
    adapters: dict[str, tuple[Route, ...]] = field(default_factory=dict)
    ambiguous_adapters: dict[str, list[str]] = field(default_factory=dict)  # bare -> qualified names


def served_from_deployments(items: Iterable[Mapping[str, Any]]) -> list[Served]:
    """LLMDeployments (API JSON) -> their names; objects without a string model name are skipped."""
    out = []
    for item in items:
        meta = item.get("metadata") or {}
        model = (item.get("spec") or {}).get("model") or {}
        name, aliases = model.get("name"), model.get("aliases") or []
        if isinstance(name, str) and name and meta.get("namespace") and meta.get("name"):
            clean = tuple(a for a in aliases if isinstance(a, str) and a and a != name)
            autoscaling = (item.get("spec") or {}).get("autoscaling")
            can_wake = isinstance(autoscaling, dict) and autoscaling.get("mode", "builtin") != "hpa"
            adapters = _adapter_names(item.get("spec") or {}, {name, *clean})
            out.append(Served(str(meta["namespace"]), str(meta["name"]), name, clean, can_wake, adapters))
    return out


def _adapter_names(spec: Mapping[str, Any], model_names: set[str]) -> tuple[str, ...]:
    """`spec.adapters[].name`, each once; one named like the model or an alias (the API server refuses
    those) is left out."""
    listed = spec.get("adapters")
    items = listed if isinstance(listed, list) else []
    names = (a.get("name") for a in items if isinstance(a, dict))
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n and n not in model_names))


def naming(served: Iterable[Served]) -> Naming:
    served = sorted(served, key=lambda s: (s.namespace, s.deployment))
    namespaces_of: dict[str, set[str]] = {}
    for s in served:
        for n in (s.name, *s.aliases):
            namespaces_of.setdefault(n, set()).add(s.namespace)
    result = Naming()
    for s in served:
        qualified = f"{s.namespace}/{s.name}"
        is_unique = len(namespaces_of[s.name]) == 1
        key = s.name if is_unique else qualified
        result.keys[(s.namespace, s.deployment)] = key
        result.routes[qualified] = Route(key, s.name)
        for alias in s.aliases:
            result.routes[f"{s.namespace}/{alias}"] = Route(key, s.name)
    for s in served:
        key = result.keys[(s.namespace, s.deployment)]
        for n in (s.name, *s.aliases):
            if len(namespaces_of[n]) == 1:
                # a name beats an alias of another deployment in the namespace
                if n == s.name:
                    result.routes[n] = Route(key, s.name)
                    result.aliases.pop(n, None)
                elif n not in result.routes:
                    result.routes[n] = Route(key, s.name)
                    result.aliases[n] = key
            else:
                result.ambiguous.setdefault(n, [])
                if f"{s.namespace}/{n}" not in result.ambiguous[n]:
                    result.ambiguous[n].append(f"{s.namespace}/{n}")
    _name_adapters(served, result)
    return result


def _name_adapters(served: list[Served], result: Naming) -> None:
    """Declared adapters by the names' rule: NAMESPACE/ADAPTER always, the bare name where one
    namespace declares it; each routes to its deployment's pool under the adapter's own name."""
    namespaces_of: dict[str, set[str]] = {}
    for s in served:
        for adapter in s.adapters:
            namespaces_of.setdefault(adapter, set()).add(s.namespace)
    routes: dict[str, dict[Route, None]] = {}  # insertion-ordered sets
    for s in served:
        key = result.keys[(s.namespace, s.deployment)]
        for adapter in s.adapters:
            route = Route(key, adapter, adapter=adapter)
            qualified = f"{s.namespace}/{adapter}"
            routes.setdefault(qualified, {})[route] = None
            if len(namespaces_of[adapter]) == 1:
                routes.setdefault(adapter, {})[route] = None
            elif qualified not in (choices := result.ambiguous_adapters.setdefault(adapter, [])):
                choices.append(qualified)
    result.adapters.update({name: tuple(sorted(rs, key=lambda r: r.key)) for name, rs in routes.items()})
