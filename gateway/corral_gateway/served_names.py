"""The model names a replica says it serves (the ids of its OpenAI `/v1/models`), read to check that
it serves the name the gateway sends it requests under (pure)."""

from __future__ import annotations

import json


def parse_model_ids(body: bytes) -> tuple[str, ...] | None:
    """The ids a `/v1/models` body lists (sorted, each once); None when the body is no such list."""
    try:
        listing = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        return None
    items = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(items, list):
        return None
    ids = {item["id"] for item in items if isinstance(item, dict) and isinstance(item.get("id"), str)}
    return tuple(sorted(ids))
