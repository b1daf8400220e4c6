"""`corral check --base-url URL`: is an OpenAI-compatible endpoint serving? List its models, then send
one short chat completion to one of them. The chart's `helm test` pod runs it against the gateway.

Standard library only, so it runs in every Corral image whatever extras it installed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import urllib.error
import urllib.request
from typing import Any

log = logging.getLogger(__name__)
# Never send the check through a proxy from the environment: it targets the endpoint itself.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class CheckFailed(Exception):
    """The endpoint could not be reached or did not answer as an OpenAI endpoint should."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    parser.add_argument("--model", help="the model to ask (default: the first one listed)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CORRAL_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $CORRAL_API_KEY, else none)",
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens to generate")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request")


def _call(
    args: argparse.Namespace, path: str, body: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
    """The JSON answer to GET (or POST `body` to) `path`, and its x-request-id."""
    headers = {"content-type": "application/json"}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(args.base_url.rstrip("/") + path, data=data, headers=headers)
    try:
        with _OPENER.open(request, timeout=args.timeout) as response:
            return json.loads(response.read()), response.headers.get("x-request-id", "")
    except urllib.error.HTTPError as e:
        hint = ""
        if e.code == 404 and args.base_url.rstrip("/").endswith("/v1"):
            hint = f" (the base URL is the server root: drop the trailing /v1 from {args.base_url})"
        raise CheckFailed(f"{path}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}{hint}") from e
    except (urllib.error.URLError, OSError) as e:
        raise CheckFailed(f"{path}: cannot reach {args.base_url}: {e}") from e
    except ValueError as e:
        raise CheckFailed(f"{path}: the answer is not JSON: {e}") from e


def check(args: argparse.Namespace) -> None:
    models, _ = _call(args, "/v1/models")
    names = [str(m.get("id")) for m in models.get("data") or [] if isinstance(m, dict)]
    log.info("models: %s", ", ".join(names) or "(none)")
    model = args.model or (names[0] if names else None)
    if model is None:
        raise CheckFailed("the endpoint serves no model yet")
    if model not in names:
        raise CheckFailed(f"model {model!r} is not among the served models {names}")
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": args.max_tokens,
    }
    reply, request_id = _call(args, "/v1/chat/completions", body)
    try:
        usage = reply["usage"]
        finish = reply["choices"][0]["finish_reason"]
    except (KeyError, IndexError, TypeError) as e:
        raise CheckFailed(f"the chat completion has no choices or usage: {str(reply)[:300]}") from e
    log.info(
        "chat completion from %s: request %s, %s completion tokens, finish_reason %s",
        model,
        request_id or reply.get("id"),
        usage.get("completion_tokens"),
        finish,
    )


def run(args: argparse.Namespace) -> int:
    try:
        check(args)
    except CheckFailed as e:
        log.error("check failed: %s", e)
        return 1
    log.info("check passed")
    return 0
