"""API keys file parsing and per-key request/token limits."""

from __future__ import annotations

import time

import pytest
from corral_gateway.auth import TokenBucket, parse_keys
from corral_gateway.body_reader import ReportedUsage
from corral_gateway.errors import RateLimited, Unauthorized
from corral_gateway.quota import TokenUsage


def test_plain_file_one_key_per_line() -> None:
    store = parse_keys("# comment\nsk-one\n\n  sk-two  \n")
    assert len(store.keys) == 2
    key = store.authenticate({"authorization": "Bearer sk-two"})
    assert key.limits.requests_per_minute is None
    assert "sk-two" not in repr(key)


def test_yaml_file_with_limits_and_defaults() -> None:
    store = parse_keys(
        "default_limits: {requests_per_minute: 60}\n"
        "keys:\n  - key: sk-a\n    name: team-a\n    tokens_per_minute: 1000\n  - sk-b\n"
    )
    a = store.authenticate({"authorization": "Bearer sk-a"})
    b = store.authenticate({"x-api-key": "sk-b"})
    assert (a.name, a.limits.requests_per_minute, a.limits.tokens_per_minute) == ("team-a", 60, 1000)
    assert b.limits.requests_per_minute == 60 and b.limits.tokens_per_minute is None


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer nope"}, {"authorization": "Basic sk-a"}, {"authorization": "Bearer "}],
)
def test_missing_or_wrong_key_is_401(headers: dict[str, str]) -> None:
    store = parse_keys("sk-a\n")
    with pytest.raises(Unauthorized) as info:
        store.authenticate(headers)
    assert info.value.status_code == 401


@pytest.mark.parametrize(
    "text", ["keys: 3\n", "keys:\n  - {name: x}\n", "keys:\n  - key: a\n    requests_per_minute: -1\n"]
)
def test_malformed_yaml_is_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_keys(text)


def test_request_limit_then_refill() -> None:
    store = parse_keys("keys:\n  - key: sk-a\n    requests_per_minute: 2\n")
    key = store.authenticate({"authorization": "Bearer sk-a"})
    store.admit(key, 10, now_s=0.0)
    store.admit(key, 10, now_s=0.0)
    with pytest.raises(RateLimited) as info:
        store.admit(key, 10, now_s=1.0)
    assert info.value.status_code == 429 and int(info.value.headers()["retry-after"]) >= 1
    store.admit(key, 10, now_s=31.0)  # one request refilled after 30 s


def test_token_limit_charges_estimate_and_settles_actual_usage() -> None:
    store = parse_keys("keys:\n  - key: sk-a\n    tokens_per_minute: 100\n")
    key = store.authenticate({"authorization": "Bearer sk-a"})
    store.admit(key, 80, now_s=0.0)
    store.settle_tokens(key, 80, 150, now_s=0.0)  # used more than estimated: in debt
    with pytest.raises(RateLimited):
        store.admit(key, 1, now_s=1.0)
    store.admit(key, 1, now_s=60.0)


def test_token_bucket_wait_time() -> None:
    bucket = TokenBucket.per_minute(60, now_s=0.0)
    bucket.charge(60, now_s=0.0)
    assert bucket.wait_s(1, now_s=0.0) == pytest.approx(1.0)
    assert bucket.wait_s(1, now_s=1.0) == 0.0


def test_a_refund_gives_the_estimate_back_once() -> None:
    store = parse_keys("keys:\n  - key: sk-a\n    tokens_per_minute: 100\n")
    key = store.authenticate({"authorization": "Bearer sk-a"})
    now_s = time.monotonic()
    store.admit(key, 150, now_s)  # in debt: the next request would wait
    refused = TokenUsage.track(store, key, 150)
    assert refused is not None
    refused.refund()  # it was not served: the key is whole again
    store.admit(key, 150, now_s)  # in debt again, for a request that is served
    refused.refund()  # a second refund of the same request credits nothing
    refused.settle(ReportedUsage(10, 10, 20))  # nor does a late report
    with pytest.raises(RateLimited):
        store.admit(key, 1, now_s)
