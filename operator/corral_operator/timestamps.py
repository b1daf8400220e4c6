"""RFC 3339 timestamps as status fields and annotations carry them, to and from epoch seconds (pure)."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

log = logging.getLogger(__name__)


def rfc3339(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def parse_time(value: str | None) -> float | None:
    """RFC 3339 UTC ('2026-01-01T00:00:00Z', fractions allowed) or epoch seconds; None if neither."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
    except ValueError:
        log.warning("ignoring unparseable time %r", value)
        return None
