"""Embeddings and rerank requests: several inputs grouped into one request, sent whole and timed
end to end, their tokens counted from the server's usage (an encoder adds its [CLS]/[SEP] there)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from corral_cli.bench.client import MAX_ERROR_CHARS, RequestSettings, error_message
from corral_cli.bench.stats import RequestResult
from corral_cli.bench.workload import BenchRequest

POOLING_ENDPOINTS = {"embeddings": "/v1/embeddings", "rerank": "/v1/rerank"}


@dataclass(frozen=True, slots=True)
class PoolingRequest:
    """One embeddings request (`inputs`, texts or token-id lists) or one rerank request (`query`
    and `inputs` as its documents); `prompt_len` is the client's count of their tokens."""

    inputs: list[str] | list[list[int]]
    prompt_len: int
    query: str | None = None


def inputs_per_request(endpoint_type: str, batch_size: int) -> int:
    """How many sampled prompts one request takes: a rerank's query is one more."""
    return batch_size + 1 if endpoint_type == "rerank" else batch_size


def group_inputs(prompts: list[BenchRequest], endpoint_type: str, batch_size: int) -> list[PoolingRequest]:
    """Consecutive prompts grouped `batch_size` to a request (rerank: a query, then its documents);
    ValueError when rerank gets token ids (its query and documents are texts)."""
    size = inputs_per_request(endpoint_type, batch_size)
    if len(prompts) % size:
        raise ValueError(f"{len(prompts)} prompts do not group into requests of {size}")
    requests = []
    for start in range(0, len(prompts), size):
        group = prompts[start : start + size]
        texts_or_ids: list[Any] = [p.prompt for p in group]
        prompt_len = sum(p.prompt_len for p in group)
        if endpoint_type != "rerank":
            requests.append(PoolingRequest(texts_or_ids, prompt_len))
            continue
        if not all(isinstance(t, str) for t in texts_or_ids):
            raise ValueError(
                "--endpoint-type rerank sends texts: give --tokenizer DIR to decode token-id prompts"
            )
        requests.append(PoolingRequest(texts_or_ids[1:], prompt_len, query=texts_or_ids[0]))
    return requests


def build_pooling_body(settings: RequestSettings, request: PoolingRequest) -> dict[str, Any]:
    """The JSON body of one embeddings or rerank request."""
    body: dict[str, Any] = {"model": settings.model}
    if settings.endpoint_type == "rerank":
        body["query"] = request.query
        body["documents"] = request.inputs
    else:
        body["input"] = request.inputs
        # The API's default (settings.extra_body may ask for base64); the vectors are not decoded.
        body["encoding_format"] = "float"
    body.update(settings.extra_body or {})
    return body


def check_reply(endpoint_type: str, reply: Any, num_inputs: int) -> tuple[int | None, str]:
    """The server's prompt tokens from a 200's body, and "" or what is wrong with it (the wrong
    number of vectors or scores, no usage)."""
    if not isinstance(reply, dict):
        return None, "the answer is not a JSON object"
    items = reply.get("results" if endpoint_type == "rerank" else "data")
    if not isinstance(items, list) or len(items) != num_inputs:
        count = len(items) if isinstance(items, list) else 0
        return None, f"answered {count} results for {num_inputs} inputs"
    usage = reply.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        return None, "response without usage"
    return tokens, ""


async def send_pooling_request(
    client: aiohttp.ClientSession, settings: RequestSettings, request: PoolingRequest
) -> RequestResult:
    """Send one request and wait for its whole answer; never raises for server or network trouble
    (the result records it). Its latency is end to end: there is no first token."""
    result = RequestResult(
        prompt_len=request.prompt_len, num_inputs=len(request.inputs), is_streamed=False, is_generation=False
    )
    url = settings.base_url.rstrip("/") + POOLING_ENDPOINTS[settings.endpoint_type]
    body = build_pooling_body(settings, request)
    start = time.perf_counter()
    try:
        async with client.post(url, json=body) as response:
            data = await response.read()
            result.e2el_s = time.perf_counter() - start
            if response.status != 200:
                result.error = error_message(response.status, data)
                return result
            reply = json.loads(data)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: a body that is not JSON
        result.error = f"{type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}"
        return result
    prompt_tokens, problem = check_reply(settings.endpoint_type, reply, len(request.inputs))
    if prompt_tokens is None:
        result.error = problem
        return result
    result.is_success = True
    result.prompt_len = prompt_tokens  # the server's count: an encoder's [CLS]/[SEP] included
    return result
