"""kopf's watch-stream log lines at the level they deserve: a 429 on a watch is retried until it
passes (the API server answers so while it re-initialises a CRD's storage, after every CRD update),
so it is a WARNING, not the ERROR kopf logs for every failed request."""

from __future__ import annotations

import logging

WATCH_LOGGER = "kopf._cogs.clients.watching"  # the logger kopf's watch requests log their retries on
TOO_MANY_REQUESTS = "APITooManyRequestsError"


class WatchThrottleFilter(logging.Filter):
    """Downgrades a watch request's 429 from ERROR to WARNING (kopf retries a watch stream forever)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and TOO_MANY_REQUESTS in record.getMessage():
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


_FILTER = WatchThrottleFilter()


def install() -> None:
    """Idempotent: the filter goes on kopf's watching logger once per process."""
    logging.getLogger(WATCH_LOGGER).addFilter(_FILTER)
