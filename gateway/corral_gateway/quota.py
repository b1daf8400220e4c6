"""Token quotas settled from the real usage: a token-limited key is charged an estimate on admission,
then the difference once the response's `usage` (at the end of its body) has passed through."""

from __future__ import annotations

import re
import time

from corral_gateway.auth import ApiKey, KeyStore

_TAIL_BYTES = 4096  # enough for the usage object at the end of a response
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


class TokenUsage:
    """The body's last bytes for one request of a token-limited key, read for `total_tokens` at the end."""

    def __init__(self, keystore: KeyStore, api_key: ApiKey, estimated_tokens: int) -> None:
        self._keystore, self._api_key, self._estimated_tokens = keystore, api_key, estimated_tokens
        self._tail = bytearray()

    @classmethod
    def track(
        cls, keystore: KeyStore | None, api_key: ApiKey | None, estimated_tokens: int
    ) -> TokenUsage | None:
        """A tracker when the key has a token limit; None otherwise (nothing to settle)."""
        if keystore is None or api_key is None or not api_key.limits.tokens_per_minute:
            return None
        return cls(keystore, api_key, estimated_tokens)

    def feed(self, chunk: bytes) -> None:
        self._tail.extend(chunk)
        del self._tail[:-_TAIL_BYTES]

    def settle(self) -> None:
        """Charge (or refund) the difference between the estimate and the last `total_tokens` seen."""
        found = _TOTAL_TOKENS.findall(bytes(self._tail))
        if found:
            now_s = time.monotonic()
            self._keystore.settle_tokens(self._api_key, self._estimated_tokens, int(found[-1]), now_s)
