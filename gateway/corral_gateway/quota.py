"""The usage a response reports, read from its last bytes, and token quotas settled from it: a
token-limited key is charged an estimate on admission, then the difference once the response's
`usage` (at the end of its body) has passed through."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from corral_gateway.auth import ApiKey, KeyStore

_TAIL_BYTES = 4096  # enough for the usage object at the end of a response
# Chat's and completions' names, and the Responses API's (`input_tokens`, `output_tokens`).
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


@dataclass(frozen=True, slots=True)
class ReportedUsage:
    """The last `usage` object of a response (a stream's last one holds the totals)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageTail:
    """A response body's last bytes, kept as they pass through, to read its `usage` at the end."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = bytearray()

    def feed(self, chunk: bytes) -> None:
        self._tail.extend(chunk)
        if len(self._tail) > _TAIL_BYTES:
            del self._tail[:-_TAIL_BYTES]

    def end(self, num_bytes: int) -> bytes:
        """The body's last `num_bytes` bytes so far (fewer while it is shorter)."""
        return bytes(self._tail[-num_bytes:])

    def reported(self) -> ReportedUsage | None:
        """None when the body reported no usage (a stream without `include_usage`, an error)."""
        tail = bytes(self._tail)
        total = _TOTAL_TOKENS.findall(tail)
        if not total:
            return None
        prompt, completion = _PROMPT_TOKENS.findall(tail), _COMPLETION_TOKENS.findall(tail)
        return ReportedUsage(
            int(prompt[-1]) if prompt else 0, int(completion[-1]) if completion else 0, int(total[-1])
        )


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
