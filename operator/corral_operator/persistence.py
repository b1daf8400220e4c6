"""What kopf remembers between an object's events (the last handled spec, handler retries), kept in the
operator's memory, not on the object, so `kubectl describe llmd` shows no bookkeeping JSON. Reconcile is
level-triggered: a restart loses only the RollingOut/Updated Event of a change made while none ran."""

from __future__ import annotations

from typing import Any, cast

import kopf

# What an operator before this module wrote on each LLMDeployment (its last-handled-configuration is
# read once, so an upgrade still sees a change made while it restarted), and the touch that woke a
# delayed handler: removed once the handlers are done.
STALE_KEYS = ("last-handled-configuration", "kopf-managed", "touch-dummy")


def _uid(body: kopf.Body) -> str | None:
    """The object's uid; None once it is being deleted (its memory is dropped then: nothing is diffed
    or retried for it again)."""
    if body.metadata.get("deletionTimestamp"):
        return None
    return cast(str | None, body.metadata.get("uid"))


class MemoryDiffBaseStorage(kopf.DiffBaseStorage):
    """The last handled essence of each object: kopf's (spec, labels, annotations) plus
    metadata.generation, so an update handler can tell a user's change (a new generation) from a field
    the API server filled in (a newer CRD's default)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self._legacy = kopf.AnnotationsDiffBaseStorage(prefix=prefix)
        self._stale_keys = [f"{prefix}/{key}" for key in STALE_KEYS]
        self._essences: dict[str, kopf.BodyEssence] = {}

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        essence = super().build(body=body, extra_fields=extra_fields)
        self.remove_annotations(essence, self._stale_keys)
        self.remove_empty_stanzas(essence)
        generation = body.metadata.get("generation")
        if generation is not None:
            cast(dict[str, Any], essence).setdefault("metadata", {})["generation"] = generation
        return essence

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        uid = _uid(body)
        if uid is None:
            self._essences.pop(cast(str, body.metadata.get("uid")), None)
            return None
        return self._essences.get(uid) or self._legacy.fetch(body=body)

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        uid = _uid(body)
        if uid is not None:
            self._essences[uid] = essence
        for key in self._stale_keys:
            if key in body.metadata.annotations:
                patch.metadata.annotations[key] = None


class MemoryProgressStorage(kopf.AnnotationsProgressStorage):
    """Handler progress (retries, delays) per object and handler. Only the touch that wakes a delayed
    handler is still written to the object (a short timestamp annotation): kopf needs an event."""

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix=prefix)
        self._records: dict[tuple[str, str], kopf.ProgressRecord] = {}

    def fetch(self, *, key: kopf.HandlerId, body: kopf.Body) -> kopf.ProgressRecord | None:
        uid = _uid(body)
        if uid is None:
            gone = cast(str, body.metadata.get("uid"))
            self._records = {k: v for k, v in self._records.items() if k[0] != gone}
            return None
        return self._records.get((uid, key))

    def store(
        self, *, key: kopf.HandlerId, record: kopf.ProgressRecord, body: kopf.Body, patch: kopf.Patch
    ) -> None:
        uid = _uid(body)
        if uid is not None:
            self._records[(uid, key)] = record

    def purge(self, *, key: kopf.HandlerId, body: kopf.Body, patch: kopf.Patch) -> None:
        self._records.pop((cast(str, body.metadata.get("uid")), key), None)
        super().purge(key=key, body=body, patch=patch)  # a record an older operator left on the object
