"""The models a replica says it serves (its OpenAI `/v1/models`): their ids, checked against the name
the gateway sends it requests under, and each one's entry (max_model_len, created, ...), which the
gateway's own `/v1/models` passes on (pure)."""

from __future__ import annotations

import json
from typing import Any

# What the gateway's own listing takes from a replica's entry; the rest (vLLM's `permission`, the
# replica's `root` path) describes that one server, not the pool the gateway routes.
CARD_FIELDS = ("created", "owned_by", "max_model_len")
# What ties an adapter's entry to its base model (vLLM's `parent`) and says where it was loaded
# from (`root`); read for adapters only.
_LINEAGE_FIELDS = ("parent", "root")


def parse_model_list(body: bytes) -> dict[str, dict[str, Any]] | None:
    """id -> the fields of its entry a listing passes on (and an adapter's `parent` and `root`), for
    each model a `/v1/models` body lists; None when the body is no such list."""
    try:
        listing = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        return None
    items = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(items, list):
        return None
    return {
        item["id"]: {k: item[k] for k in (*CARD_FIELDS, *_LINEAGE_FIELDS) if k in item}
        for item in items
        if isinstance(item, dict) and isinstance(item.get("id"), str)
    }


def parse_model_ids(body: bytes) -> tuple[str, ...] | None:
    """The ids a `/v1/models` body lists (sorted, each once); None when the body is no such list."""
    listed = parse_model_list(body)
    return None if listed is None else tuple(sorted(listed))
