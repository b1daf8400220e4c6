"""LoRA adapters loaded at run time through the gateway (pure): the load and unload bodies, which
pool such a call goes to, the adapters each pool's replicas must serve from then on, and what a
fan-out that failed on some replica must undo."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from corral_gateway.errors import InvalidRequest

# vLLM's runtime endpoints (an engine registers them with --allow-runtime-lora-updating).
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
# The optional field naming the base model (vLLM's --lora-modules JSON key): the pool to load on.
BASE_FIELD = "base_model_name"


@dataclass(frozen=True, slots=True)
class AdapterCall:
    """A load or unload body: the adapter, where from (loads), the base model if named, and the
    body itself, forwarded to each replica byte for byte (vLLM's other fields pass through)."""

    name: str
    path: str | None
    base: str | None
    body: bytes


def parse_call(raw: bytes, is_load: bool) -> AdapterCall:
    """The body of a load (`lora_name`, `lora_path`) or an unload (`lora_name`); 400 in the
    engine's words when a field is missing, as vLLM answers it."""
    try:
        body: Any = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("The body is not valid JSON.") from None
    wanted = ("lora_name", "lora_path") if is_load else ("lora_name",)
    values = [body.get(name) if isinstance(body, dict) else None for name in wanted]
    strings = [v for v in values if isinstance(v, str) and v]
    if len(strings) < len(wanted):
        listed = " and ".join(f"'{n}'" for n in wanted)
        raise InvalidRequest(f"{listed} must be provided.", param=wanted[0])
    base = body.get(BASE_FIELD)
    if base is not None and not (isinstance(base, str) and base):
        raise InvalidRequest(f"'{BASE_FIELD}' must be a model name.", param=BASE_FIELD)
    return AdapterCall(strings[0], strings[1] if is_load else None, base, raw)


def choose_pool(pools: Collection[str], what: str) -> str:
    """The one pool `what` can mean, when the body names no base model; 400 naming the choices."""
    if len(pools) == 1:
        return next(iter(pools))
    if not pools:
        raise InvalidRequest(f"No model serves LoRA adapters here to {what}.", param=BASE_FIELD)
    listed = ", ".join(f"`{p}`" for p in sorted(pools))
    raise InvalidRequest(
        f"Several models serve LoRA adapters ({listed}): name one as `{BASE_FIELD}` to {what}.",
        param=BASE_FIELD,
        code="model_ambiguous",
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """One replica's answer to a load or unload: 200 when it holds (or no longer holds) the
    adapter, `is_changed` if this call did that; else its status (502: not reached) and error."""

    url: str
    status: int
    is_changed: bool = False
    error: Mapping[str, Any] | None = None

    @property
    def is_ok(self) -> bool:
        return self.status == 200


def rollback_plan(outcomes: Iterable[Outcome]) -> list[str]:
    """The replicas a load must be undone on: none when every one succeeded; else those where
    this load loaded it (one that had it before keeps it)."""
    outcomes = list(outcomes)
    if all(o.is_ok for o in outcomes):
        return []
    return [o.url for o in outcomes if o.is_ok and o.is_changed]


def failure_message(verb: str, name: str, pool: str, outcomes: list[Outcome], undone: list[str]) -> str:
    """What the client is told when a fan-out failed somewhere: the replicas that failed and why."""
    failed = [o for o in outcomes if not o.is_ok]
    reasons = "; ".join(f"{o.url}: HTTP {o.status} {_message(o.error)}".rstrip() for o in failed)
    text = (
        f"Could not {verb} LoRA adapter '{name}' on {len(failed)} of {len(outcomes)} replicas of "
        f"`{pool}` ({reasons})."
    )
    if undone:
        text += f" It was unloaded again from {', '.join(undone)}."
    return text


def _message(error: Mapping[str, Any] | None) -> str:
    message = error.get("message") if error is not None else None
    return f"({message})" if isinstance(message, str) and message else ""


@dataclass(frozen=True, slots=True)
class RuntimeAdapter:
    name: str
    body: bytes  # the load's body, sent again to each replica that lacks the adapter


class RuntimeAdapters:
    """Pool -> the adapters loaded through the gateway: every replica of the pool that becomes
    ready later gets them (`missing`), and they route and wake the pool as declared ones do."""

    def __init__(self) -> None:
        self._by_pool: dict[str, dict[str, RuntimeAdapter]] = {}

    def remember(self, pool: str, name: str, body: bytes) -> None:
        self._by_pool.setdefault(pool, {})[name] = RuntimeAdapter(name, body)

    def forget(self, pool: str, name: str) -> bool:
        """Forget an unloaded adapter; returns whether it was remembered."""
        adapters = self._by_pool.get(pool, {})
        is_known = adapters.pop(name, None) is not None
        if not adapters:
            self._by_pool.pop(pool, None)
        return is_known

    def names(self, pool: str) -> frozenset[str]:
        return frozenset(self._by_pool.get(pool, {}))

    def by_pool(self) -> dict[str, frozenset[str]]:
        """Pool -> the names remembered for it (the adapter table routes them)."""
        return {pool: frozenset(adapters) for pool, adapters in self._by_pool.items()}

    def missing(self, pool: str, listed: Collection[str]) -> list[RuntimeAdapter]:
        """The remembered adapters of `pool` that a replica listing `listed` lacks."""
        return [a for name, a in sorted(self._by_pool.get(pool, {}).items()) if name not in listed]
