"""OpenAI's batch file format, as `corral run-batch` reads and writes it (and vLLM's `run-batch`):
one request a line in, one result a line out. Pure: no I/O, no network.

In: `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
Out: `{"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id":
"...", "body": {...}}, "error": null}`; a request that got no HTTP answer has `"response": null`
and an `error` with a code and a message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The routes a batch line may name: OpenAI's batch endpoints that Corral serves, and vLLM's
# scoring routes, which its run-batch takes too.
URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
)
MAX_ERRORS_SHOWN = 20


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of the file; `number` is its line in the file (1-based)."""

    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


class BatchFileError(ValueError):
    """The file cannot run: every problem found, each naming its line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:MAX_ERRORS_SHOWN]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        super().__init__(
            f"the batch file has {len(problems)} invalid line(s); nothing was sent:\n  "
            + "\n  ".join(shown)
            + more
        )


def parse_batch(lines: Iterable[str]) -> list[BatchLine]:
    """Every request of the file, checked as OpenAI checks an uploaded batch file before it runs;
    BatchFileError listing each bad line. Blank lines are skipped."""
    requests: list[BatchLine] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = _parse_line(number, text)
        except ValueError as e:
            problems.append(f"line {number}: {e}")
            continue
        if line.custom_id in first_line:
            first = first_line[line.custom_id]
            problems.append(f"line {number}: custom_id {line.custom_id!r} is already used on line {first}")
            continue
        first_line[line.custom_id] = number
        requests.append(line)
    if problems:
        raise BatchFileError(problems)
    if not requests:
        raise BatchFileError(["the file holds no requests"])
    return requests


def _parse_line(number: int, text: str) -> BatchLine:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a request is a JSON object, got {type(value).__name__}")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    method = value.get("method", "POST")
    if method != "POST":
        raise ValueError(f"method must be POST, got {method!r}")
    url = value.get("url")
    if url not in URLS:
        raise ValueError(f"url must be one of {', '.join(URLS)}; got {url!r}")
    body = value.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (the request's own body)")
    if body.get("stream"):
        raise ValueError("body.stream: batch requests are answered whole, they cannot stream")
    return BatchLine(number, custom_id, url, body)


def result_line(
    line: BatchLine,
    status_code: int | None,
    body: Any = None,
    request_id: str = "",
    error: tuple[str, str] | None = None,
) -> str:
    """The output line for `line`: its HTTP answer (`status_code`, `body`), or with no answer
    (`status_code` None) the `error` (code, message)."""
    response = (
        None if status_code is None else {"status_code": status_code, "request_id": request_id, "body": body}
    )
    record = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": response,
        "error": None if error is None else {"code": error[0], "message": error[1]},
    }
    return json.dumps(record, separators=(",", ":"))


def usage_of(body: Any) -> tuple[int, int]:
    """(prompt tokens, completion tokens) an answer's usage reports; (0, 0) without one."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return (prompt if isinstance(prompt, int) else 0), (completion if isinstance(completion, int) else 0)
