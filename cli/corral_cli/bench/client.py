"""Send one request to /v1/completions or /v1/chat/completions and time it: a streamed one chunk by
chunk, a non-streamed one (`RequestSettings.stream` off) as a whole.

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
MAX_ERROR_CHARS = 200


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
    # False: one JSON response per request (batch-style traffic); its first token's time is the
    # whole response's, and there are no inter-token gaps.
    stream: bool = True


def build_body(settings: RequestSettings, request: BenchRequest) -> dict[str, Any]:
    """The JSON body for one benchmark request (streamed with usage in the last chunk, or not)."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": settings.max_tokens_cap or request.output_len,
        "temperature": settings.temperature,
        "stream": settings.stream,
    }
    if settings.stream:
        body["stream_options"] = {"include_usage": True}
    if settings.max_tokens_cap and settings.stream:
        # A server that merges tokens for a slow reader (vLLM, Corral) sends chunks of several
        # tokens; its running usage on every chunk says how many arrived (others ignore the field).
        body["stream_options"]["continuous_usage_stats"] = True
    if settings.endpoint_type == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("chat requests need text prompts (give --tokenizer to decode token ids)")
        content: str | list[dict[str, Any]] = request.prompt
        if request.image_urls:  # OpenAI's content parts: the text, then each image
            images = [{"type": "image_url", "image_url": {"url": url}} for url in request.image_urls]
            content = [{"type": "text", "text": request.prompt}, *images]
        body["messages"] = [{"role": "user", "content": content}]
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
    return f"HTTP {status}: {str(message)[:MAX_ERROR_CHARS]}"


_MAX_LINE_BYTES = 1 << 20  # an SSE line longer than this is a broken stream, not a big chunk


class _StreamError(Exception):
    """The server reported an error inside the stream."""


@dataclass(slots=True)
class _StreamReading:
    """One stream's events as they arrive: chunk times, tokens, the usage seen last."""

    result: RequestResult
    endpoint_type: str
    start: float
    last: float
    stop_after: int | None = None
    num_chunks: int = 0
    num_tokens: int = 0
    usage: Any = None
    done: bool = False  # [DONE] seen, or the capped length reached
    end: float | None = None  # when a capped stream was cut

    def line(self, line: bytes, now: float) -> None:
        """One line of the body, read at `now` (every line of one read shares its time)."""
        if not line.startswith(b"data:"):
            return
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            raise _StreamError(f"stream error: {str(event['error'])[:MAX_ERROR_CHARS]}")
        running = event.get("usage")
        self.usage = running or self.usage
        if chunk_text(event, self.endpoint_type):
            if self.num_chunks == 0:
                self.result.ttft_s = now - self.start
            else:
                self.result.itl_s.append(now - self.last)
            self.last = now
            self.num_chunks += 1
        if isinstance(running, dict) and event.get("choices"):
            self.num_tokens = int(running.get("completion_tokens") or self.num_tokens)  # running usage
        else:
            self.num_tokens += carries_token(event, self.endpoint_type)
        if self.stop_after is not None and self.num_tokens >= self.stop_after:
            self.done = True
            self.end = time.perf_counter()


async def send_request(
    client: aiohttp.ClientSession, settings: RequestSettings, request: BenchRequest
) -> RequestResult:
    """Stream one request; never raises for server or network trouble (the result records it).

    With `settings.max_tokens_cap`, the stream is closed (which aborts the request on the server)
    once `request.output_len` tokens have arrived, and what arrived by then is the output counted:
    the sampled length, or a few more when the last chunk carried several tokens. Tokens are
    counted from the server's running usage where it sends one, else one per chunk with a token.

    The body is read as it arrives, not line by line: one wake-up per network read, however many
    events it brings (a server streaming to hundreds of clients writes each a step's chunk at
    once), and every event of one read is timed at that read.
    """
    result = RequestResult(prompt_len=request.prompt_len)
    url = settings.base_url.rstrip("/") + ENDPOINTS[settings.endpoint_type]
    body = build_body(settings, request)
    if not settings.stream:
        return await _send_whole(client, url, body, result)
    start = time.perf_counter()
    reading = _StreamReading(
        result, settings.endpoint_type, start, start, request.output_len if settings.max_tokens_cap else None
    )
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                result.error = error_message(response.status, await response.read())
                return result
            pending = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    reading.line(line, now)
                    if reading.done:
                        break
                if reading.done:
                    if reading.end is not None:
                        response.close()  # drop the connection: the server aborts (a client-side EOS)
                    break
                if len(pending) > _MAX_LINE_BYTES:
                    raise ValueError(f"an SSE line over {_MAX_LINE_BYTES} bytes")
    except _StreamError as e:
        result.error = str(e)
        return result
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: bad JSON, huge line
        result.error = f"{type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}"
        return result
    result.e2el_s = (reading.end or time.perf_counter()) - start
    if reading.num_chunks == 0:
        result.ttft_s = result.e2el_s  # nothing streamed before the end
    if not reading.done:
        result.error = "stream ended without [DONE]"
    elif reading.end is not None:
        result.is_success = True
        result.output_len = reading.num_tokens  # the server reports no usage for a stream cut short
    else:
        result.is_success = True
        _record_usage(result, reading.usage, reading.num_chunks)
    return result


async def _send_whole(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], result: RequestResult
) -> RequestResult:
    """A non-streamed request: the response read whole; its tokens from the usage it reports."""
    result.is_streamed = False
    start = time.perf_counter()
    try:
        async with client.post(url, json=body) as response:
            data = await response.read()
            result.e2el_s = result.ttft_s = time.perf_counter() - start
            if response.status != 200:
                result.error = error_message(response.status, data)
                return result
            reply = json.loads(data)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}"
        return result
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(usage, dict) or "completion_tokens" not in usage:
        result.error = "response without usage"
        return result
    result.is_success = True
    _record_usage(result, usage, 0)
    return result


def _record_usage(result: RequestResult, usage: Any, num_chunks: int) -> None:
    """Token counts from the server's usage report, else one output token per text chunk."""
    if isinstance(usage, dict):
        result.output_len = int(usage.get("completion_tokens") or num_chunks)
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
    else:
        result.output_len = num_chunks
