"""API keys and per-key request / token rate limits (pure apart from reading and re-reading the keys file).

The file is either one key per line, or YAML: `keys: [{key, name, requests_per_minute,
tokens_per_minute}]` with optional `default_limits`. A Kubernetes Secret mounted as a file works the
same. Keys are held only as SHA-256 digests and named in logs and metrics by a short hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from corral_gateway.errors import RateLimited, Unauthorized

logger = logging.getLogger(__name__)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyLimits:
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str  # short hash: safe in logs, metrics and as the fairness key
    name: str
    limits: KeyLimits


@dataclass(slots=True)
class TokenBucket:
    """Refills continuously up to `capacity`; a level below zero is debt from actual usage."""

    capacity: float
    refill_per_s: float
    level: float
    updated_s: float

    @classmethod
    def per_minute(cls, amount: float, now_s: float) -> TokenBucket:
        return cls(capacity=amount, refill_per_s=amount / 60.0, level=amount, updated_s=now_s)

    def _refill(self, now_s: float) -> None:
        elapsed = max(0.0, now_s - self.updated_s)
        self.level = min(self.capacity, self.level + elapsed * self.refill_per_s)
        self.updated_s = now_s

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until `amount` fits (0 if it fits now)."""
        self._refill(now_s)
        missing = min(amount, self.capacity) - self.level
        return 0.0 if missing <= 0 else missing / self.refill_per_s

    def charge(self, amount: float, now_s: float) -> None:
        self._refill(now_s)
        self.level -= amount


@dataclass(slots=True)
class KeyStore:
    keys: dict[str, ApiKey]  # sha256 hex digest -> key
    _requests: dict[str, TokenBucket] = field(default_factory=dict)
    _tokens: dict[str, TokenBucket] = field(default_factory=dict)

    def authenticate(self, headers: Mapping[str, str]) -> ApiKey:
        presented = bearer_token(headers)
        if presented is None:
            raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        api_key = self.keys.get(key_digest(presented))
        if api_key is None:
            raise Unauthorized("Incorrect API key provided.")
        return api_key

    def admit(self, api_key: ApiKey, estimated_tokens: int, now_s: float) -> None:
        """Charge one request and its estimated tokens, or raise 429 with Retry-After."""
        limits = api_key.limits
        requests = self._bucket(self._requests, api_key.key_id, limits.requests_per_minute, now_s, "requests")
        # Allow a request while any token budget is left; actual usage settles the debt afterwards.
        tokens = self._bucket(self._tokens, api_key.key_id, limits.tokens_per_minute, now_s, "tokens")
        if requests is not None:
            requests.charge(1.0, now_s)
        if tokens is not None:
            tokens.charge(float(estimated_tokens), now_s)

    @staticmethod
    def _bucket(
        buckets: dict[str, TokenBucket], key_id: str, per_minute: float | None, now_s: float, what: str
    ) -> TokenBucket | None:
        """The key's bucket for `what` (None when unlimited); raises 429 while it is empty."""
        if per_minute is None:
            return None
        bucket = buckets.setdefault(key_id, TokenBucket.per_minute(per_minute, now_s))
        wait = bucket.wait_s(1.0, now_s)
        if wait > 0:
            raise RateLimited(
                f"Rate limit reached for {what}.", retry_after_s=wait, code=f"rate_limit_{what}"
            )
        return bucket

    def settle_tokens(self, api_key: ApiKey, estimated_tokens: int, actual_tokens: int, now_s: float) -> None:
        bucket = self._tokens.get(api_key.key_id)
        if bucket is not None:
            bucket.charge(float(actual_tokens - estimated_tokens), now_s)

    def carry_buckets_from(self, old: KeyStore) -> None:
        """Keep the limits' state across a reload of the keys file."""
        live_ids = {k.key_id for k in self.keys.values()}
        self._requests = {k: b for k, b in old._requests.items() if k in live_ids}
        self._tokens = {k: b for k, b in old._tokens.items() if k in live_ids}


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if value:
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    api_key = headers.get("x-api-key")
    return api_key.strip() if api_key and api_key.strip() else None


def parse_keys(text: str) -> KeyStore:
    """Parse a keys file's text; raises ValueError on a malformed file."""
    loaded: Any
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        loaded = None
    if isinstance(loaded, dict | list):
        return _parse_yaml_keys(loaded)
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return _store([(k, None, KeyLimits()) for k in keys])


def _parse_yaml_keys(loaded: dict[str, Any] | list[Any]) -> KeyStore:
    entries = loaded.get("keys", []) if isinstance(loaded, dict) else loaded
    defaults = _limits(loaded.get("default_limits") or {}) if isinstance(loaded, dict) else KeyLimits()
    if not isinstance(entries, list):
        raise ValueError("`keys` must be a list")
    parsed: list[tuple[str, str | None, KeyLimits]] = []
    for entry in entries:
        if isinstance(entry, str):
            parsed.append((entry, None, defaults))
        elif isinstance(entry, dict) and isinstance(entry.get("key"), str):
            limits = _limits(entry, defaults)
            parsed.append((entry["key"], entry.get("name"), limits))
        else:
            raise ValueError("each entry of `keys` must be a string or a mapping with a string `key`")
    return _store(parsed)


def _limits(entry: dict[str, Any], defaults: KeyLimits = KeyLimits()) -> KeyLimits:
    def number(name: str, default: float | None) -> float | None:
        value = entry.get(name, default)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"`{name}` must be a positive number")
        return float(value)

    return KeyLimits(
        requests_per_minute=number("requests_per_minute", defaults.requests_per_minute),
        tokens_per_minute=number("tokens_per_minute", defaults.tokens_per_minute),
    )


def _store(entries: list[tuple[str, str | None, KeyLimits]]) -> KeyStore:
    keys: dict[str, ApiKey] = {}
    for key, name, limits in entries:
        if not key.strip():
            raise ValueError("an API key must not be empty")
        digest = key_digest(key.strip())
        keys[digest] = ApiKey(key_id=digest[:12], name=str(name or digest[:12]), limits=limits)
    return KeyStore(keys=keys)


def load_keys_file(path: Path) -> KeyStore:
    return parse_keys(path.read_text(encoding="utf-8"))


_KEYS_RELOAD_INTERVAL_S = 2.0


class KeysFile:
    """The API keys, reloaded when the file changes (a rotated Kubernetes Secret, say)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.store: KeyStore | None = load_keys_file(path) if path is not None else None
        self._mtime_ns = path.stat().st_mtime_ns if path is not None else 0

    def get(self) -> KeyStore | None:
        return self.store

    def reload_if_changed(self) -> None:
        if self.path is None:
            return
        try:
            mtime_ns = self.path.stat().st_mtime_ns
            if mtime_ns == self._mtime_ns:
                return
            fresh = load_keys_file(self.path)
        except (OSError, ValueError) as e:
            logger.error("keeping the previous API keys: cannot reload %s: %s", self.path, e)
            return
        if self.store is not None:
            fresh.carry_buckets_from(self.store)
        self.store, self._mtime_ns = fresh, mtime_ns
        logger.info("reloaded %d API keys from %s", len(fresh.keys), self.path)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(_KEYS_RELOAD_INTERVAL_S)
            self.reload_if_changed()
