"""`corral run-batch -i IN.jsonl -o OUT.jsonl`: run a file of OpenAI batch requests (chat,
completions, embeddings, responses, score, rerank) against an OpenAI-compatible server
(`--base-url`: an engine, the gateway, `corral up`), or against a local engine it starts for the
batch and stops after (`--model`, as vLLM's `run-batch`; it serves the model under the name the
file's lines give it). Results are written in the input's order,
each line as soon as the lines before it are done, so a long batch's output grows as it runs.

The file is checked whole before anything is sent (a bad line stops the batch, naming its line);
busy answers (429, 502, 503, 504, with their Retry-After) and refused connections are retried;
every other answer, errors included, is written as the server gave it. Exit status: 0 when every
request got a 2xx, 1 when some did not (the output still holds every line), 2 for a bad file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from corral_cli.batch_file import BatchFileError, BatchLine, parse_batch, result_line, usage_of
from corral_cli.flags import non_negative_int, positive_float, positive_int

log = logging.getLogger(__name__)

RETRY_STATUSES = (429, 502, 503, 504)
MAX_RETRY_WAIT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL; '-': stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="where results go (JSONL; '-': stdout)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--base-url", help="an OpenAI-compatible server's root (no /v1): an engine, the gateway"
    )
    target.add_argument(
        "--model",
        help="serve this model (directory, hf://, s3://, pvc://) with a local engine for the batch; "
        "engine flags go after --, e.g. -- --max-model-len 4096",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CORRAL_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $CORRAL_API_KEY, else none)",
    )
    parser.add_argument("--max-concurrency", type=positive_int, default=64, help="requests in flight")
    parser.add_argument(
        "--max-retries",
        type=non_negative_int,
        default=3,
        help="retries of a busy answer or refused connection",
    )
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds a request may take")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("engine_flags", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


@dataclass
class Summary:
    """What the batch did: answers by status code, requests with no answer, tokens reported."""

    statuses: dict[int, int] = field(default_factory=dict)
    no_answer: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def failed(self) -> int:
        return self.no_answer + sum(n for code, n in self.statuses.items() if not 200 <= code < 300)

    def describe(self, num_requests: int, seconds: float) -> str:
        codes = ", ".join(f"{n} x {code}" for code, n in sorted(self.statuses.items()))
        lost = f", {self.no_answer} without an answer" if self.no_answer else ""
        return (
            f"{num_requests} requests in {seconds:.1f} s ({num_requests / max(seconds, 1e-9):.2f}/s): "
            f"{num_requests - self.failed} succeeded, {self.failed} failed ({codes}{lost}); "
            f"{self.prompt_tokens} prompt and {self.completion_tokens} completion tokens"
        )


@dataclass(frozen=True, slots=True)
class Settings:
    base_url: str
    headers: dict[str, str]
    max_concurrency: int
    max_retries: int
    timeout_s: float
    show_progress: bool


def run(args: argparse.Namespace) -> int:
    engine_flags = [f for f in args.engine_flags if f != "--"] if args.engine_flags else []
    if engine_flags and args.model is None:
        log.error(
            "engine flags (%s) are for --model: a server at --base-url runs its own", " ".join(engine_flags)
        )
        return 2
    try:
        lines = parse_batch(_read_lines(args.input_file))
    except (OSError, BatchFileError) as e:
        log.error("%s", e)
        return 2
    if args.model is not None:
        names = sorted({str(line.body["model"]) for line in lines if "model" in line.body})
        if len(names) > 1:
            log.error("the file names %d models (%s); --model serves one", len(names), ", ".join(names))
            return 2
        if names and "--served-model-name" not in engine_flags:
            engine_flags += ["--served-model-name", names[0]]  # serve it as the file names it
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with _local_engine(args, engine_flags) as base_url:
        if base_url is None:
            return 1
        settings = Settings(
            base_url.rstrip("/").removesuffix("/v1"),
            headers,
            args.max_concurrency,
            args.max_retries,
            args.timeout,
            not args.no_progress,
        )
        with _output(args.output_file) as out:
            started = time.monotonic()
            summary = asyncio.run(run_batch(lines, settings, out))
    if summary is None:
        return 1
    log.info("%s", summary.describe(len(lines), time.monotonic() - started))
    return 1 if summary.failed else 0


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    return Path(path).read_text(encoding="utf-8").splitlines()


@contextlib.contextmanager
def _output(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdout
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as out:
        yield out


@contextlib.contextmanager
def _local_engine(args: argparse.Namespace, engine_flags: list[str]) -> Iterator[str | None]:
    """--base-url as given; or for --model an engine started on a loopback port, stopped (drained)
    when the batch is done; None when it did not start (its log's tail is logged)."""
    if args.model is None:
        yield args.base_url
        return
    from corral_cli.local_engines import (
        DEFAULT_DRAIN_TIMEOUT_S,
        LocalEngine,
        LogDir,
        stop_engines,
        wait_ready,
    )

    log_dir = LogDir(None)
    flags = ["--model", args.model, *engine_flags]
    log_flags = ["--log-level", str(args.log_level), "--log-format", str(args.log_format)]
    engine = LocalEngine(flags, len(os.sched_getaffinity(0)), log_dir.create(), log_flags)
    has_failed = True
    try:
        log.info("starting an engine for %s (its log: %s)", args.model, engine.log_path)
        try:
            wait_ready([engine])
        except RuntimeError as e:
            log.error("%s", e)
            yield None
            return
        yield engine.urls[0]
        has_failed = False
    finally:
        stop_engines([engine], DEFAULT_DRAIN_TIMEOUT_S)
        log_dir.close(has_failed=has_failed or not engine.has_stopped_cleanly())


async def run_batch(lines: list[BatchLine], settings: Settings, out: IO[str]) -> Summary | None:
    """Send every line (at most `max_concurrency` at once) and write each result in file order;
    None when the server cannot be reached at all (nothing is written then)."""
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=settings.max_concurrency)
    timeout = httpx.Timeout(settings.timeout_s, connect=min(10.0, settings.timeout_s))
    async with httpx.AsyncClient(
        base_url=settings.base_url, headers=settings.headers, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        if not await _reachable(client, settings.base_url, lines):
            return None
        summary = Summary()
        done: dict[int, str] = {}
        written = 0
        pending = iter(enumerate(lines))
        with tqdm(total=len(lines), unit="req", disable=not settings.show_progress, file=sys.stderr) as bar:

            async def worker() -> None:
                nonlocal written
                for index, line in pending:  # one iterator shared: each line goes to one worker
                    done[index] = await _send(client, line, settings, summary)
                    bar.update()
                    while written in done:
                        out.write(done.pop(written) + "\n")
                        written += 1
                    out.flush()

            await asyncio.gather(*(worker() for _ in range(min(settings.max_concurrency, len(lines)))))
    return summary


async def _reachable(client: Any, base_url: str, lines: list[BatchLine]) -> bool:
    """Whether the server answers its model list (logging why not); warns of models it lacks."""
    import httpx

    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as e:
        log.error("cannot reach %s: %s", base_url, e or type(e).__name__)
        return False
    if response.status_code in (401, 403):
        log.error("%s refused the model list (%d): is --api-key right?", base_url, response.status_code)
        return False
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        served = {m["id"] for m in response.json()["data"]}
        asked = {str(line.body.get("model")) for line in lines}
        if asked - served:
            log.warning("%s does not list the model(s) %s", base_url, ", ".join(sorted(asked - served)))
    return True


async def _send(client: Any, line: BatchLine, settings: Settings, summary: Summary) -> str:
    """One line's result: the server's answer, after retrying busy answers and refused
    connections up to --max-retries times."""
    import httpx

    for attempt in range(settings.max_retries + 1):
        is_last = attempt == settings.max_retries
        try:
            response = await client.post(line.url, json=line.body)
        except httpx.TimeoutException:
            # Not retried: the server may still be working on it, and would again.
            return _no_answer(line, summary, "timeout", f"no answer within {settings.timeout_s:g} s")
        except httpx.TransportError as e:
            if is_last:
                return _no_answer(line, summary, "connection_error", str(e) or type(e).__name__)
            await asyncio.sleep(_backoff_s(attempt, None))
            continue
        if response.status_code in RETRY_STATUSES and not is_last:
            await asyncio.sleep(_backoff_s(attempt, response.headers.get("retry-after")))
            continue
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        summary.statuses[response.status_code] = summary.statuses.get(response.status_code, 0) + 1
        if 200 <= response.status_code < 300:
            prompt, completion = usage_of(body)
            summary.prompt_tokens += prompt
            summary.completion_tokens += completion
        return result_line(line, response.status_code, body, response.headers.get("x-request-id", ""))
    raise AssertionError("unreachable: the last attempt returns")


def _no_answer(line: BatchLine, summary: Summary, code: str, message: str) -> str:
    summary.no_answer += 1
    return result_line(line, None, error=(code, message))


def _backoff_s(attempt: int, retry_after: str | None) -> float:
    """The server's Retry-After (seconds) where it gave one, else 1, 2, 4 ... s; at most a minute."""
    if retry_after is not None:
        with contextlib.suppress(ValueError):
            return min(max(float(retry_after), 0.0), MAX_RETRY_WAIT_S)
    return min(2.0**attempt, MAX_RETRY_WAIT_S)
