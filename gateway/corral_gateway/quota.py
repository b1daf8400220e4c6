"""Token quotas settled from the usage a response reports: a token-limited key is charged an
estimate on admission, then the difference once the response's `usage` (at the end of its body,
read by `body_reader`) has passed through."""

from __future__ import annotations

import time

from corral_gateway.auth import ApiKey, KeyStore
from corral_gateway.body_reader import ReportedUsage


class TokenUsage:
    """A token-limited key's charge for one request, settled from the usage its response reports."""

    def __init__(self, keystore: KeyStore, api_key: ApiKey, estimated_tokens: int) -> None:
        self._keystore, self._api_key, self._estimated_tokens = keystore, api_key, estimated_tokens
        self._is_settled = False

    @classmethod
    def track(
        cls, keystore: KeyStore | None, api_key: ApiKey | None, estimated_tokens: int
    ) -> TokenUsage | None:
        """A tracker when the key has a token limit; None otherwise (nothing to settle)."""
        if keystore is None or api_key is None or not api_key.limits.tokens_per_minute:
            return None
        return cls(keystore, api_key, estimated_tokens)

    def settle(self, reported: ReportedUsage | None) -> None:
        """Charge (or refund) the difference between the estimate and the reported total, once;
        without a report the estimate stands."""
        if reported is not None and not self._is_settled:
            self._is_settled = True
            now_s = time.monotonic()
            self._keystore.settle_tokens(self._api_key, self._estimated_tokens, reported.total_tokens, now_s)

    def refund(self) -> None:
        """Nothing was served (an error answer, the gateway's or a replica's): the estimate is
        given back, so requests refused for their size or shed under load cost no tokens."""
        self.settle(ReportedUsage(0, 0, 0))
