"""Send one streamed request to /v1/completions or /v1/chat/completions and time its chunks.

The client is aiohttp: its HTTP parser is C, so reading a token's SSE event costs the load
generator a few tens of microseconds; with httpx (pure Python) it was ~140, which made a load
generator sharing a small machine with the server the bottleneck at a few thousand tokens/s.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from corral_cli.bench.stats import RequestResult
from corral_cli.bench.workload import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_MAX_ERROR_CHARS = 200


@dataclass(frozen=True, slots=True)
class RequestSettings:
    base_url: str
    model: str
    endpoint_type: str = "completions"  # "completions" | "chat"
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] | None = None
    # Send max_tokens = this cap and end each stream once its sampled output length has arrived, so
    # the server does not know the real length in advance (as with a real EOS). None: max_tokens is
    # the sampled length.
    max_tokens_cap: int | None = None
    # Sent with every request (the API key's Authorization, --header); never written to results.
    headers: dict[str, str] | None = None


def build_body(settings: RequestSettings, request: BenchRequest) -> dict[str, Any]:
    """The JSON body for one benchmark request (streamed, with usage in the last chunk)."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": settings.max_tokens_cap or request.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.max_tokens_cap:
        # A server that merges tokens for a slow reader (vLLM, Corral) sends chunks of several
        # tokens; its running usage on every chunk says how many arrived (others ignore the field).
        body["stream_options"]["continuous_usage_stats"] = True
    if settings.endpoint_type == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("chat requests need text prompts (give --tokenizer to decode token ids)")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension Corral's engine shares
    body.update(settings.extra_body or {})
    body.update(request.extra_body or {})  # the request's own fields win over the run's
    return body


def chunk_text(event: dict[str, Any], endpoint_type: str) -> str:
    """The generated text an SSE event carries ("" for role-only or usage-only events)."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint_type == "chat":
        delta = choice.get("delta") or {}
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def carries_token(event: dict[str, Any], endpoint_type: str) -> bool:
    """Whether an SSE event carries a generated token (Corral and vLLM stream one chunk per token
    without speculative decoding); a token may decode to no text yet. Role-only and finish-only
    chunks carry none."""
    if chunk_text(event, endpoint_type):
        return True
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    if choice.get("finish_reason"):
        return False
    return not (endpoint_type == "chat" and "role" in (choice.get("delta") or {}))


def error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return f"HTTP {status}: {str(message)[:_MAX_ERROR_CHARS]}"


async def send_request(
    client: aiohttp.ClientSession, settings: RequestSettings, request: BenchRequest
) -> RequestResult:
    """Stream one request; never raises for server or network trouble (the result records it).

    With `settings.max_tokens_cap`, the stream is closed (which aborts the request on the server)
    once `request.output_len` tokens have arrived, and what arrived by then is the output counted:
    the sampled length, or a few more when the last chunk carried several tokens. Tokens are
    counted from the server's running usage where it sends one, else one per chunk with a token.
    """
    result = RequestResult(prompt_len=request.prompt_len)
    url = settings.base_url.rstrip("/") + ENDPOINTS[settings.endpoint_type]
    body = build_body(settings, request)
    stop_after = request.output_len if settings.max_tokens_cap else None
    num_chunks, num_tokens, usage = 0, 0, None
    start = last = time.perf_counter()
    end: float | None = None  # when a capped stream was cut
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                result.error = error_message(response.status, await response.read())
                return result
            async for line in response.content:  # one line at a time, b"\n" included
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    result.is_success = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {str(event['error'])[:_MAX_ERROR_CHARS]}"
                    return result
                running = event.get("usage")
                usage = running or usage
                if chunk_text(event, settings.endpoint_type):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
                if isinstance(running, dict) and event.get("choices"):
                    num_tokens = int(running.get("completion_tokens") or num_tokens)  # running usage
                else:
                    num_tokens += carries_token(event, settings.endpoint_type)
                if stop_after is not None and num_tokens >= stop_after:
                    result.is_success = True
                    end = time.perf_counter()
                    response.close()  # drop the connection: the server aborts (a client-side EOS)
                    break
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: bad JSON, huge line
        result.error = f"{type(e).__name__}: {str(e)[:_MAX_ERROR_CHARS]}"
        return result
    result.e2el_s = (end or time.perf_counter()) - start
    if num_chunks == 0:
        result.ttft_s = result.e2el_s  # nothing streamed before the end
    if not result.is_success:
        result.error = "stream ended without [DONE]"
    elif end is not None:
        result.output_len = num_tokens  # the server reports no usage for a stream cut short
    else:
        _record_usage(result, usage, num_chunks)
    return result


def _record_usage(result: RequestResult, usage: Any, num_chunks: int) -> None:
    """Token counts from the server's usage report, else one output token per text chunk."""
    if isinstance(usage, dict):
        result.output_len = int(usage.get("completion_tokens") or num_chunks)
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
    else:
        result.output_len = num_chunks
