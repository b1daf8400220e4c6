"""Which request paths the gateway proxies to a replica of the body's model, and which it answers."""

from __future__ import annotations

import re

from corral_gateway.runtime_adapters import LOAD_PATH, UNLOAD_PATH

PROXY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # POST only: other methods 405
# vLLM's POST routes outside /v1, forwarded like /v1's (the body's `model` picks the replicas);
# /v2/rerank is its rerank for Cohere's clients.
VLLM_PATHS = frozenset(
    {"/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/v2/rerank"}
)
# vLLM's runtime LoRA routes: answered by the gateway, which sends them to every replica of a pool.
ADAPTER_PATHS = frozenset({LOAD_PATH, UNLOAD_PATH})


# The paths forwarded as they are: the URL library re-reads `%` escapes and resolves `.` and `..`
# segments, so `/v1/../sleep` (or `/v1/%252e%252e/sleep`) would have reached a replica's routes
# outside /v1, such as a vLLM replica's admin ones.
_FORWARDABLE_PATH = re.compile(r"/v1(/[A-Za-z0-9_~-][A-Za-z0-9._~-]*)+")
# A stored response's routes (OpenAI's Responses API): no body names a model to route them by, and
# no replica stores responses, so the gateway answers them itself.
_STORED_RESPONSE_PATH = re.compile(r"/v1/responses/[^/]+(/input_items|/cancel)?")


def is_proxied(method: str, path: str) -> bool:
    """Every POST a backend serves goes to a replica of the body's model: /v1/* (embeddings,
    responses, audio, ... as well as completions and chat) and vLLM's own routes."""
    if path in PROXY_PATHS:
        return True
    if method != "POST" or path in ADAPTER_PATHS or _STORED_RESPONSE_PATH.fullmatch(path) is not None:
        return False
    return _FORWARDABLE_PATH.fullmatch(path) is not None or path in VLLM_PATHS
