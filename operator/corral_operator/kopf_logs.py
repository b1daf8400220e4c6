"""kopf's log lines at the level they deserve. kopf logs every failed API request at ERROR, but two
are expected: a 429 on a watch (the API server answers so while it re-initialises a CRD's storage,
after every CRD update; kopf retries until it passes) and an Event posted into a namespace being
deleted (its objects go with it; nobody can read that Event)."""

from __future__ import annotations

import logging

WATCH_LOGGER = "kopf._cogs.clients.watching"  # the logger kopf's watch requests log their retries on
POSTING_LOGGER = "kopf._core.engines.posting"  # the logger kopf's Event posts log their retries on
TOO_MANY_REQUESTS = "APITooManyRequestsError"
# The API server's NamespaceLifecycle refusal: "unable to create new content in namespace X because it
# is being terminated" (403).
NAMESPACE_TERMINATING = "because it is being terminated"


class _Lower(logging.Filter):
    """Lowers the records at or above WARNING whose message holds `marker` to `level`."""

    def __init__(self, marker: str, level: int) -> None:
        super().__init__()
        self.marker, self.level = marker, level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and self.marker in record.getMessage():
            record.levelno, record.levelname = self.level, logging.getLevelName(self.level)
        return True


# A watch's 429 stays visible (a CRD update is worth a line); a doomed Event is only debugging.
_FILTERS = {
    WATCH_LOGGER: _Lower(TOO_MANY_REQUESTS, logging.WARNING),
    POSTING_LOGGER: _Lower(NAMESPACE_TERMINATING, logging.DEBUG),
}


def install() -> None:
    """Idempotent: each filter goes on its kopf logger once per process."""
    for name, log_filter in _FILTERS.items():
        logging.getLogger(name).addFilter(log_filter)
