"""Acceptance 2 and 4: a replica killed under load, then re-admitted; a model's only replica killed
and a backend named unlike its engine, both visible to monitoring; API keys through the gateway."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
from pathlib import Path

import httpx
import openai
import pytest

from e2e.gateway.conftest import MODEL, replica_state, restart_engine, start_gateway, wait_for
from e2e.procs import EngineProcess, ManagedProcess, start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAM_TOKENS = 480
PLAIN_TOKENS = 120


def stream_outcome(url: str, started: cf.Future[None]) -> str:
    """'done' when the stream ends with [DONE] after every token, 'error' when with an error event
    (then [DONE], as every stream ends)."""
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}  # a chunk may carry several tokens: count them
    events = _stream_events(url, body, started)
    assert events[-1] == "[DONE]", events[-1]
    if "error" in json.loads(events[-2]):
        return "error"
    usage, last = json.loads(events[-2])["usage"], json.loads(events[-3])
    assert usage["completion_tokens"] == STREAM_TOKENS and last["choices"][0]["finish_reason"] == "length"
    return "done"


def plain_request(url: str) -> int:
    body = {"model": MODEL, "prompt": "Count", "max_tokens": PLAIN_TOKENS, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(600, connect=5))
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["completion_tokens"])


def served_by(gateway: ManagedProcess, url: str) -> float:
    return gateway.metric("corral_gateway_requests_total", replica=url, status="200")


def test_kill_a_replica_under_load_then_readmit(tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = {"served_model_name": MODEL, "max_num_seqs": 4}
    with start_engine(tiny_model_dir, **flags) as victim, start_engine(tiny_model_dir, **flags) as survivor:
        backends = {MODEL: [victim.url, survivor.url]}
        # The survivor serves ~5,000 tokens, 4 sequences at a time: on a loaded machine requests
        # queued behind it outlived the default 30 s queue deadline (503), which is not under test.
        settings = {"policy": "round-robin", "ejection_s": 0.5, "queue_timeout_s": 600}
        with start_gateway(backends, tmp_path, **settings) as gateway:
            try:
                outcomes = _kill_under_load(gateway, victim)
                assert "error" in outcomes and "done" in outcomes, outcomes
                assert gateway.metric("corral_gateway_retries_total") >= 1
                assert gateway.metric("corral_gateway_streams_broken_total") == outcomes.count("error")
                wait_for("ejection", lambda: not replica_state(gateway)[victim.url]["healthy"])
                assert gateway.metric("corral_gateway_ejections_total", replica=victim.url) >= 1
                # Re-admitted once healthy again on the same address, and it takes traffic.
                with restart_engine(tiny_model_dir, victim.port, max_num_seqs=4):
                    wait_for("re-admission", lambda: replica_state(gateway)[victim.url]["healthy"], 60)
                    before = served_by(gateway, victim.url)
                    for _ in range(6):
                        plain_request(gateway.url)
                    assert served_by(gateway, victim.url) > before
                assert gateway.proc.poll() is None
            except (AssertionError, cf.TimeoutError, httpx.HTTPError) as e:
                raise AssertionError(f"{e!r}\n--- gateway log ---\n{gateway.log_tail()}") from e


def _kill_under_load(gateway: ManagedProcess, victim: EngineProcess) -> list[str]:
    """SIGKILL `victim` while streams run and plain requests wait on it; returns the streams' outcomes."""
    with cf.ThreadPoolExecutor(32) as pool:
        started = [cf.Future[None]() for _ in range(6)]
        streams = [pool.submit(stream_outcome, gateway.url, s) for s in started]
        cf.wait(started, timeout=60)
        plains = [pool.submit(plain_request, gateway.url) for _ in range(12)]
        wait_for("requests queued on the victim", lambda: victim.metric("vllm:num_requests_waiting") > 0)
        victim.signal(signal.SIGKILL)
        victim.proc.wait(10)
        # More traffic right after the kill: some is routed to the dead replica, then retried.
        plains += [pool.submit(plain_request, gateway.url) for _ in range(6)]
        # Streams end, none hangs: [DONE] on the survivor, an error event on the victim.
        outcomes = [s.result(timeout=600) for s in streams]  # guards against a hang
        # Requests that had not started streaming all succeed elsewhere.
        assert [p.result(timeout=600) for p in plains] == [PLAIN_TOKENS] * len(plains)
    return outcomes


def test_a_sole_replica_killed_and_a_misnamed_backend_show_in_health(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # `demo` routes to an engine that serves MODEL only: every request for it would get a 404.
    with start_engine(tiny_model_dir, served_model_name=MODEL) as engine:
        backends = {MODEL: [engine.url], "demo": [engine.url]}
        with start_gateway(backends, tmp_path) as gateway:
            try:
                _sole_replica_killed(gateway, engine)
            except (AssertionError, cf.TimeoutError, httpx.HTTPError) as e:
                raise AssertionError(f"{e!r}\n--- gateway log ---\n{gateway.log_tail()}") from e


def _models_down(gateway: ManagedProcess) -> list[str]:
    health = httpx.get(gateway.url + "/health", timeout=5)
    assert health.status_code == 200  # alive whatever its replicas do (the liveness probe)
    return list(health.json()["models_down"])


def _sole_replica_killed(gateway: ManagedProcess, engine: EngineProcess) -> None:
    wait_for("the misnamed backend", lambda: _models_down(gateway) == ["demo"])
    demo = httpx.get(gateway.url + "/corral/replicas", timeout=5).json()["models"]["demo"][0]
    assert demo["served_names"] == [MODEL] and demo["serves_model"] is False and not demo["ejected"]
    assert f"backend 'demo': replica {engine.url} serves '{MODEL}', not 'demo'" in gateway.log_tail(100_000)
    assert replica_state(gateway)[engine.url]["healthy"]
    with cf.ThreadPoolExecutor(1) as pool:
        started = cf.Future[None]()
        stream = pool.submit(stream_outcome, gateway.url, started)
        started.result(timeout=60)
        engine.signal(signal.SIGKILL)
        engine.proc.wait(10)
        assert stream.result(timeout=60) == "error"  # an error event, then [DONE]
    # Never ejected (requests still try it), but monitoring sees it down.
    wait_for("the dead replica to show", lambda: _models_down(gateway) == ["demo", MODEL], 10)
    assert not replica_state(gateway)[engine.url]["healthy"]
    assert gateway.metric("corral_gateway_replica_healthy", model=MODEL, replica=engine.url) == 0
    assert gateway.metric("corral_gateway_ejections_total", replica=engine.url) == 0


def test_api_keys_through_the_gateway(tiny_model_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-e2e-good\n    requests_per_minute: 3\n  - key: sk-e2e-other\n")
    with (
        start_engine(tiny_model_dir, served_model_name=MODEL) as engine,
        start_gateway({MODEL: [engine.url]}, tmp_path, api_keys_file=str(keys)) as gateway,
    ):

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)

        request = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        with pytest.raises(openai.AuthenticationError):
            client("sk-wrong").completions.create(**request)  # type: ignore[call-overload]
        no_key = httpx.post(gateway.url + "/v1/completions", json=request)
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        for _ in range(3):
            assert client("sk-e2e-good").completions.create(**request).usage is not None  # type: ignore[call-overload]
        with pytest.raises(openai.RateLimitError) as info:
            client("sk-e2e-good").completions.create(**request)  # type: ignore[call-overload]
        assert int(info.value.response.headers["retry-after"]) >= 1
        # Another key is not limited by the first one's usage.
        assert client("sk-e2e-other").completions.create(**request).usage is not None  # type: ignore[call-overload]
        assert "sk-e2e" not in httpx.get(gateway.url + "/metrics").text
        assert "sk-e2e" not in gateway.log_tail(100_000)


def test_a_stopped_gateway_drains_then_ends_an_open_stream_with_a_draining_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM: new requests get a 503 `draining`; a stream still open when drain_timeout_s is up
    ends with a `draining` error event and [DONE] (it used to run on without limit, until the pod's
    SIGKILL cut it), and the gateway exits 0. The engine is stopped (SIGSTOP) meanwhile, so the
    stream is certainly still open at the drain's end."""
    with start_engine(tiny_model_dir, served_model_name=MODEL) as engine:
        with start_gateway({MODEL: [engine.url]}, tmp_path, drain_timeout_s=3) as gateway:
            try:
                _stopped_mid_stream(gateway, engine)
            except (AssertionError, cf.TimeoutError, httpx.HTTPError) as e:
                raise AssertionError(f"{e!r}\n--- gateway log ---\n{gateway.log_tail()}") from e
            finally:
                engine.signal(signal.SIGCONT)
        # The gateway closed the stream's upstream request: the engine aborted it.
        wait_for("the engine to abort it", lambda: engine.metric("vllm:num_requests_running") == 0)


def _stopped_mid_stream(gateway: ManagedProcess, engine: EngineProcess) -> None:
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
    with cf.ThreadPoolExecutor(1) as pool:
        started = cf.Future[None]()
        stream = pool.submit(_stream_events, gateway.url, body, started)
        started.result(timeout=60)
        engine.signal(signal.SIGSTOP)
        gateway.signal(signal.SIGTERM)
        wait_for("readiness to fail", lambda: httpx.get(gateway.url + "/ready", timeout=5).status_code == 503)
        refused = httpx.post(gateway.url + "/v1/completions", json=body, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        events = stream.result(timeout=60)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "draining" and error["type"] == "service_unavailable"
    assert gateway.proc.wait(30) == 0


def _stream_events(url: str, body: dict[str, object], started: cf.Future[None]) -> list[str]:
    events = []
    with (
        httpx.Client(timeout=httpx.Timeout(60, connect=5)) as http,
        http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if not started.done():
                    started.set_result(None)
    return events
