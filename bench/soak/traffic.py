"""The soak's traffic: Poisson arrivals of a fixed mix of request kinds through the gateway, each
checked against what a user should get (a whole stream ending in [DONE], a JSON body, an
OpenAI-style error with the right status, or a stream the client drops after its first chunks)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

_WORDS = ("note", "ledger", "replica", "block", "prefix", "stream", "token", "gateway", "engine", "queue")


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    weight: float
    path: str
    status: int  # what the client should get
    stream: bool = False
    disconnect_after: int = 0  # chunks read before the client drops the stream (0: read it all)


KINDS = (
    Kind("stream", 0.45, "/v1/chat/completions", 200, stream=True),
    Kind("whole", 0.2, "/v1/completions", 200),
    Kind("n2", 0.05, "/v1/completions", 200),
    Kind("disconnect", 0.15, "/v1/chat/completions", 200, stream=True, disconnect_after=2),
    Kind("invalid", 0.1, "/v1/chat/completions", 400),
    Kind("unknown_model", 0.05, "/v1/chat/completions", 404),
)


def body(kind: Kind, index: int, model: str, rng: random.Random) -> dict[str, Any]:
    """A request of `kind`; every prompt starts with its own number, so none share a block."""
    text = f"{index} " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(40, 160)))
    max_tokens = 256 if kind.disconnect_after else rng.randint(8, 48)
    out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": kind.stream}
    if kind.path == "/v1/completions":
        out["prompt"] = text
    else:
        out["messages"] = [{"role": "user", "content": text}]
    if kind.name == "n2":
        out["n"] = 2
    elif kind.name == "invalid":
        out["temperature"] = -1.0
    elif kind.name == "unknown_model":
        out["model"] = "no-such-model"
    if kind.stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def _read(kind: Kind, resp: aiohttp.ClientResponse) -> str:
    if resp.status != kind.status:
        return f"status {resp.status}"
    if kind.status != 200:
        error = (await resp.json(content_type=None)).get("error") or {}
        return "ok" if error.get("message") else "error without a message"
    if not kind.stream:
        doc = await resp.json(content_type=None)
        expected = 2 if kind.name == "n2" else 1
        return "ok" if len(doc.get("choices", ())) == expected else "wrong choices"
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


async def one(session: aiohttp.ClientSession, base_url: str, kind: Kind, payload: dict[str, Any]) -> str:
    try:
        async with session.post(base_url + kind.path, json=payload) as resp:
            return await _read(kind, resp)
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
) -> int:
    """Send requests at `rate` a second (Poisson) for `duration_s`; each result goes to `on_result`
    (kind, outcome) as it ends. Returns how many were sent."""
    rng = random.Random(seed)
    weights = [k.weight for k in KINDS]
    slots = asyncio.Semaphore(max_in_flight)
    timeout = aiohttp.ClientTimeout(total=300)
    tasks: set[asyncio.Task[None]] = set()

    async def send(kind: Kind, payload: dict[str, Any]) -> None:
        async with slots:
            on_result(kind.name, await one(session, base_url, kind, payload))

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
