"""An engine whose own waiting queue is full answers 429 (`--max-waiting 0 --max-num-seqs 1`): the
gateway in front keeps the requests it refused in its own queue and sends each when a place frees,
so every client gets its answer rather than the engine's 429."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import httpx
import pytest

from e2e.gateway.conftest import MODEL, start_gateway
from e2e.procs import start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 200  # long enough that the three requests overlap on a loaded machine
NUM_REQUESTS = 3  # one runs, the others are refused by the engine: the default 3 attempts suffice


def _complete(url: str) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": "Count", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(300, connect=5))
    return r.status_code, r.text


def test_requests_an_engine_refuses_for_its_full_queue_wait_in_the_gateway(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    flags = {"served_model_name": MODEL, "max_num_seqs": 1, "max_waiting": 0}
    with start_engine(tiny_model_dir, log_dir=tmp_path, **flags) as engine:
        with cf.ThreadPoolExecutor(NUM_REQUESTS) as pool:  # straight to the engine: it refuses
            direct = list(pool.map(lambda _: _complete(engine.url), range(NUM_REQUESTS)))
        assert 429 in [status for status, _ in direct], direct
        with start_gateway({MODEL: [engine.url]}, tmp_path, queue_timeout_s=300) as gateway:
            try:
                with cf.ThreadPoolExecutor(NUM_REQUESTS) as pool:
                    answers = list(pool.map(lambda _: _complete(gateway.url), range(NUM_REQUESTS)))
                assert [status for status, _ in answers] == [200] * NUM_REQUESTS, answers
                assert gateway.metric("corral_gateway_retries_total", reason="http_429") >= 1
            except (AssertionError, httpx.HTTPError) as e:
                raise AssertionError(f"{e!r}\n--- gateway log ---\n{gateway.log_tail()}") from e
