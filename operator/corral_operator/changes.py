"""What a spec update changed, in a user's words: the Event `kubectl describe llmd` shows between an
apply and the new pods becoming Available (pure; the diff is kopf's, of the last handled spec)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from corral_operator.status import Event

# spec path prefix -> the name an Event gives it (first match wins); each of these is in the pod
# template, so changing it replaces the pods.
POD_FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("engine", "image"), "image"),
    (("engine", "imagePullPolicy"), "image"),
    (("engine", "args"), "engine args"),
    (("engine", "extraArgs"), "engine args"),
    (("engine",), "engine"),
    (("model",), "model"),
    (("adapters",), "adapters"),
    (("resources",), "resources"),
    (("nodeSelector",), "placement"),
    (("tolerations",), "placement"),
    (("affinity",), "placement"),
    (("pod",), "pod settings"),
)
# Spec fields that change no pod. replicas has none: a scale is not an update worth an Event here
# (the autoscaler posts Scaled; the Deployment posts its own ScalingReplicaSet).
OTHER_FIELDS = {"autoscaling": "autoscaling", "rollout": "rollout strategy"}


def _name(path: Sequence[str]) -> tuple[str | None, bool]:
    """(what to call the field at `path` under spec, whether it is in the pod template)."""
    for prefix, name in POD_FIELDS:
        if tuple(path[: len(prefix)]) == prefix:
            return name, True
    if not path:
        return "spec", True
    return OTHER_FIELDS.get(path[0], path[0] if path[0] != "replicas" else None), False


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def update_event(
    generation: object, diff: Iterable[Sequence[Any]], *, handled_generation: object = None
) -> Event | None:
    """The Event for an update whose kopf diff is `diff` ((op, path, old, new) items): a rollout when a
    pod template field changed, else what changed; None for a scale, a change outside spec (the wake
    stamp), or a diff at `handled_generation` (no user change: a newer CRD's default filled in)."""
    if isinstance(generation, int) and generation == handled_generation:
        return None
    rolled: list[str] = []
    other: list[str] = []
    for item in diff:
        path = tuple(str(p) for p in item[1])
        if path[:1] != ("spec",):
            continue
        name, is_pod = _name(path[1:])
        if name is not None:
            (rolled if is_pod else other).append(name)
    what = f"generation {generation}" if isinstance(generation, int) else "the spec"
    if rolled:
        also = f" ({', '.join(_unique(other))} too)" if other else ""
        return Event(
            "Normal", "RollingOut", f"{what}: new pods for the changed {', '.join(_unique(rolled))}{also}"
        )
    if other:
        return Event("Normal", "Updated", f"{what}: {', '.join(_unique(other))} changed")
    return None
