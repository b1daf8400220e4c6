"""The soak's traffic: Poisson arrivals of a fixed mix of request kinds through the gateway, each
checked against what a user should get (a whole stream ending in [DONE], a JSON body, an
OpenAI-style error with the right status, or a stream the client drops after its first chunks).

Besides greedy requests with prompts of their own, the mix has sampled ones (temperature, top_p, a
seed, stop strings, log probabilities: the sampler's and the output's other paths) and ones that
open with a shared preamble (prefix-cache hits, and evictions once the cache is full)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

_WORDS = ("note", "ledger", "replica", "block", "prefix", "stream", "token", "gateway", "engine", "queue")
# Long enough to fill several KV blocks (~110 tokens of the demo tokenizer), so requests that open
# with it share them; with the rest of the prompt and the output it stays within the tiny demo
# model's 512-token context, as every kind does.
PREAMBLE = "You are the fleet's assistant. " + " ".join(_WORDS[i % len(_WORDS)] for i in range(36))
_TOP_LOGPROBS = 2


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    weight: float
    path: str
    status: int  # what the client should get
    stream: bool = False
    disconnect_after: int = 0  # chunks read before the client drops the stream (0: read it all)


KINDS = (
    Kind("stream", 0.35, "/v1/chat/completions", 200, stream=True),
    Kind("whole", 0.15, "/v1/completions", 200),
    Kind("n2", 0.05, "/v1/completions", 200),
    Kind("sampled", 0.1, "/v1/chat/completions", 200),
    Kind("shared_prefix", 0.1, "/v1/completions", 200, stream=True),
    Kind("disconnect", 0.1, "/v1/chat/completions", 200, stream=True, disconnect_after=2),
    Kind("invalid", 0.1, "/v1/chat/completions", 400),
    Kind("unknown_model", 0.05, "/v1/chat/completions", 404),
)


def body(kind: Kind, index: int, model: str, rng: random.Random) -> dict[str, Any]:
    """A request of `kind`; every prompt but a shared_prefix one's starts with its own number, so
    only those share blocks (the preamble's)."""
    words = rng.randint(20, 100) if kind.name == "shared_prefix" else rng.randint(40, 150)
    text = f"{index} " + " ".join(rng.choice(_WORDS) for _ in range(words))
    if kind.name == "shared_prefix":
        text = f"{PREAMBLE} {text}"
    max_tokens = 64 if kind.disconnect_after else rng.randint(8, 48)
    out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": kind.stream}
    if kind.path == "/v1/completions":
        out["prompt"] = text
    else:
        out["messages"] = [{"role": "user", "content": text}]
    if kind.name == "n2":
        out["n"] = 2
    elif kind.name == "sampled":
        out.update(temperature=0.8, top_p=0.9, seed=index, stop=["ledger queue"])
        out.update(logprobs=True, top_logprobs=_TOP_LOGPROBS)
    elif kind.name == "invalid":
        out["temperature"] = -1.0
    elif kind.name == "unknown_model":
        out["model"] = "no-such-model"
    if kind.stream:
        out["stream_options"] = {"include_usage": True}
    return out


def check_whole(kind: Kind, doc: dict[str, Any], exact_logprobs: bool) -> str:
    """What is wrong with a whole response's body, or "ok". With `exact_logprobs` (a model, not the
    simulator, computed them) a sampled response has a log probability, with its alternatives, for
    every token it was charged."""
    choices: list[dict[str, Any]] = doc.get("choices") or []
    if len(choices) != (2 if kind.name == "n2" else 1):
        return "wrong choices"
    if kind.name != "sampled":
        return "ok"
    content = (choices[0].get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        return "no logprobs"
    if exact_logprobs and (
        len(content) != doc["usage"]["completion_tokens"]
        or any(len(entry["top_logprobs"]) != _TOP_LOGPROBS for entry in content)
    ):
        return "logprobs do not match the tokens"
    return "ok"


async def _read(kind: Kind, resp: aiohttp.ClientResponse, exact_logprobs: bool) -> str:
    if resp.status != kind.status:  # with the error's code, which says who refused it and why
        with contextlib.suppress(ValueError, AttributeError, aiohttp.ClientError):
            error = (await resp.json(content_type=None)).get("error") or {}
            return f"status {resp.status} {error.get('code')}"
        return f"status {resp.status}"
    if kind.status != 200:
        error = (await resp.json(content_type=None)).get("error") or {}
        return "ok" if error.get("message") else "error without a message"
    if not kind.stream:
        return check_whole(kind, await resp.json(content_type=None), exact_logprobs)
    events = 0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            return "ok"
        json.loads(line[6:])
        events += 1
        if kind.disconnect_after and events >= kind.disconnect_after:
            resp.close()  # drop the connection mid-stream, as a client that goes away does
            return "ok"
    return "stream ended without [DONE]"


async def one(
    session: aiohttp.ClientSession, base_url: str, kind: Kind, payload: dict[str, Any], exact_logprobs: bool
) -> str:
    try:
        async with session.post(base_url + kind.path, json=payload) as resp:
            return await _read(kind, resp, exact_logprobs)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        return f"exception {type(e).__name__}"


async def run(
    base_url: str,
    model: str,
    rate: float,
    duration_s: float,
    seed: int,
    on_result: Callable[[str, str], None],
    max_in_flight: int = 1024,
    exact_logprobs: bool = False,
) -> int:
    """Send requests at `rate` a second (Poisson) for `duration_s`; each result goes to `on_result`
    (kind, outcome) as it ends. Returns how many were sent. `exact_logprobs`: see `check_whole`."""
    rng = random.Random(seed)
    weights = [k.weight for k in KINDS]
    slots = asyncio.Semaphore(max_in_flight)
    timeout = aiohttp.ClientTimeout(total=300)
    tasks: set[asyncio.Task[None]] = set()

    async def send(kind: Kind, payload: dict[str, Any]) -> None:
        async with slots:
            on_result(kind.name, await one(session, base_url, kind, payload, exact_logprobs))

    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=max_in_flight)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start, sent, next_at = loop.time(), 0, 0.0
        while next_at < duration_s:
            await asyncio.sleep(max(0.0, start + next_at - loop.time()))
            kind = rng.choices(KINDS, weights)[0]
            task = asyncio.create_task(send(kind, body(kind, sent, model, rng)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.gather(*tasks)
    return sent
