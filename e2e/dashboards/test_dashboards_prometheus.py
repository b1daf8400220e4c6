"""Every dashboard query returns data from a real Prometheus scraping a real local fleet under load,
and that Prometheus loads and evaluates every alert rule of the chart.

Two `corral engine` processes, each serving a LoRA adapter besides the model, and a `corral gateway`
process; a third "replica" answers every completion with 503 (a broken replica), so the gateway's
retry and ejection panels have something to show. Prometheus (Debian's binary) scrapes every second;
the openai client sends the load, some of it to the adapter.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from corral_cli.chartgen import alerts, promcheck
from corral_cli.chartgen.files import ALERT_RULES
from corral_cli.chartgen.queries import dashboard_queries, metric_names
from corral_engine import wire
from corral_engine.demo_adapter import write_demo_adapter

from e2e.procs import HOST, EngineProcess, ManagedProcess, free_port, start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-llama"
ADAPTER = "sql"  # a LoRA adapter of MODEL on both engines, for the adapter panels
# The gateway checks API keys, so the per-key token panel has a key to show.
API_KEY, KEY_NAME = "sk-dashboards-e2e", "e2e-team"
SHARED_PREFIX = "You are a helpful assistant for the Corral project. Answer briefly and precisely. "
_DATA_TIMEOUT_S = 90.0
# Panels without data on this fleet, each with why; every other query must return data, and every
# other metric queried must be exported here.
NO_DATA_HERE = {
    "Acceptance rate by draft position": "a series per draft position only with --speculative",
}
ROOT = Path(__file__).resolve().parents[2]


class _BrokenReplica(BaseHTTPRequestHandler):
    """Healthy to probes and the load poller, 503 to every completion: retried, then ejected."""

    def log_message(self, format: str, *args: object) -> None:
        return

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            gauges = (wire.NUM_REQUESTS_RUNNING, wire.NUM_REQUESTS_WAITING, wire.KV_CACHE_USAGE_PERC)
            text = "".join(f'{g}{{model_name="{MODEL}"}} 0\n' for g in gauges)
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(200, b"{}", "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        error = {"error": {"message": "broken replica", "type": "server_error", "param": None, "code": None}}
        self._send(503, json.dumps(error).encode(), "application/json")


@pytest.fixture(scope="module")
def broken_replica() -> Iterator[str]:
    server = ThreadingHTTPServer((HOST, 0), _BrokenReplica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    adapter = write_demo_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / ADAPTER)
    flags: dict[str, Any] = {"served_model_name": MODEL, "num_threads": 1, "max_num_seqs": 4}
    flags |= {"enable_lora": True, "lora_modules": f"{ADAPTER}={adapter}"}
    with start_engine(tiny_model_dir, **flags) as a, start_engine(tiny_model_dir, **flags) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def gateway(
    engines: list[EngineProcess], broken_replica: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    port = free_port()
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"key": API_KEY, "name": KEY_NAME}]}))
    argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", HOST, "--port", str(port)]
    argv += ["--api-keys-file", str(keys)]
    for url in [*(e.url for e in engines), broken_replica]:
        argv += ["--backend", f"{MODEL}={url}"]
    # Round-robin sends a share of the traffic to the broken replica whenever it is in rotation.
    argv += ["--policy", "round-robin"]
    with ManagedProcess(argv, port, name="gateway", log_dir=tmp_path_factory.mktemp("gateway")) as gw:
        gw.wait_ready(60)
        yield gw


@pytest.fixture(scope="module")
def prometheus(
    gateway: ManagedProcess, engines: list[EngineProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus not found: install Debian's prometheus package (scripts/install-system.sh)")
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    # The same config `promcheck scrape-config` gives users, from the gateway's own replica list
    # minus the broken replica (it is not an engine).
    engine_urls = [e.url for e in engines]
    assert set(engine_urls) < set(promcheck.engine_urls(gateway.url, API_KEY))
    scrape = promcheck.scrape_config(gateway.url, engine_urls, interval="1s")
    # The chart's alerts, as docs/operations.md tells a Prometheus without the operator to load them.
    scrape["rule_files"] = [str(ROOT / ALERT_RULES)]
    config.write_text(yaml.safe_dump(scrape))
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={work / 'data'}",
        f"--web.listen-address={HOST}:{port}",
        "--log.level=warn",
    ]
    with ManagedProcess(argv, port, name="prometheus", health_path="/-/ready", log_dir=work) as prom:
        prom.wait_ready(60)
        yield prom


def _one_request(client: openai.OpenAI, i: int) -> None:
    prompt = SHARED_PREFIX + f"Question {i % 5}: what is {i} plus {i}?"
    if i % 7 == 3:
        try:  # an unknown model: a 404 for the errors panel
            client.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
        except openai.NotFoundError:
            return
        raise AssertionError("an unknown model was served")
    if i % 7 == 5:
        try:  # a client mistake on a served model: a 400 for the selected model's errors panel
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=-1)
        except openai.BadRequestError:
            return
        raise AssertionError("max_tokens=-1 was accepted")
    model = ADAPTER if i % 7 == 1 else MODEL
    if i % 2:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=12, stream=True
        )
        assert list(stream)
    else:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=12)
        assert reply.usage is not None and reply.usage.completion_tokens > 0


@pytest.fixture(scope="module")
def load(gateway: ManagedProcess, prometheus: ManagedProcess) -> Iterator[list[int]]:
    """Requests through the gateway from 4 threads until the module's tests are done."""
    stop = threading.Event()
    done: list[int] = []
    errors: list[BaseException] = []
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def worker(first: int) -> None:
        i = first
        while not stop.is_set():
            try:
                _one_request(client, i)
                done.append(i)
            except Exception as e:  # reported after the tests, never swallowed
                errors.append(e)
                return
            i += 4

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(worker, n) for n in range(4)]
        yield done
        stop.set()
        for future in futures:
            future.result()
    client.close()
    assert not errors, f"load through the gateway failed: {errors[0]!r}"


def _wait_for_all_data(prometheus_url: str, model: str) -> list[promcheck.QueryResult]:
    deadline = time.monotonic() + _DATA_TIMEOUT_S
    while True:
        results = promcheck.check_dashboards(prometheus_url, model, rate_interval="30s")
        empty = [r for r in results if r.num_series == 0 and r.query.panel not in NO_DATA_HERE]
        if not empty or time.monotonic() > deadline:
            return results
        time.sleep(1.0)


@pytest.mark.parametrize("model", [MODEL, ".*"], ids=["model-selected", "all-models"])
def test_every_dashboard_query_returns_data(prometheus: ManagedProcess, load: list[int], model: str) -> None:
    results = _wait_for_all_data(prometheus.url, model)
    empty = [
        f"{r.query.dashboard}: {r.query.panel}: {r.query.expr}"
        for r in results
        if not r.num_series and r.query.panel not in NO_DATA_HERE
    ]
    assert not empty, "queries without data:\n" + "\n".join(empty)
    with_data = {r.query.panel for r in results if r.num_series} & set(NO_DATA_HERE)
    assert not with_data, f"exempt panels with data now (drop them from NO_DATA_HERE): {with_data}"
    assert len(load) > 0
    by_panel = {(r.query.panel, r.query.legend): r for r in results}
    # Spot checks that the numbers mean what the panels say.
    assert by_panel[("Replicas per model", "{{model_name}} engines")].sample == 2
    assert by_panel[("Requests/s by model", "{{model}}")].sample > 0
    assert by_panel[("Tokens/s by model", "{{model_name}} generated")].sample > 0
    assert by_panel[("Retries/s by reason", "{{model}} {{reason}}")].num_series >= 1
    assert by_panel[("Tokens/s by API key", "{{key}} {{kind}}")].num_series == 2  # prompt, completion
    adapters = by_panel[("Adapters per replica", "{{instance}}")]
    assert adapters.num_series == 2  # one row per engine; the broken replica reports no LoRA state
    assert adapters.sample is not None and 0 < adapters.sample / 1000 <= time.time()  # a change, in ms
    assert by_panel[("Adapter requests/s by model", "{{model}}")].sample > 0
    assert 0 <= by_panel[("Adapter requests finding their adapter active", "{{model}}")].sample <= 1


def test_every_dashboard_metric_is_exported_by_a_live_process(
    engines: list[EngineProcess], gateway: ManagedProcess, load: list[int]
) -> None:
    exported: set[str] = set()
    for process in [*engines, gateway]:
        for line in process.metrics_text().splitlines():
            if line.startswith("# TYPE "):
                exported.add(line.split()[2])
            elif line and not line.startswith("#"):
                exported.add(line.split("{")[0].split(" ")[0])
    queries = [q for q in dashboard_queries() if q.panel not in NO_DATA_HERE]
    named = set().union(*(metric_names(q.expr) for q in queries))
    missing = {name for name in named if name not in exported and name + "_bucket" not in exported}
    assert not missing, f"dashboards query metrics no live engine or gateway exports: {sorted(missing)}"


def test_promcheck_commands_a_user_runs(
    gateway: ManagedProcess,
    prometheus: ManagedProcess,
    load: list[int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/dashboards.md: `promcheck scrape-config` then `promcheck check` against that Prometheus."""
    argv = ["scrape-config", "--gateway", gateway.url, "--interval", "1s", "--api-key", API_KEY]
    assert promcheck.main(argv) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert jobs["corral-gateway"] == [gateway.url.removeprefix("http://")]
    assert len(jobs["corral-engines"]) == 3  # the gateway's replicas, the broken one included
    _wait_for_all_data(prometheus.url, MODEL)
    # 0: the panels without data here are event-driven ones, which the check does not fail on.
    assert promcheck.main(["check", "--prometheus", prometheus.url, "--model", MODEL]) == 0
    report = capsys.readouterr().out
    total = len(dashboard_queries())
    num_exempt = sum(q.panel in NO_DATA_HERE for q in dashboard_queries())
    assert f"{total - num_exempt} of {total} queries returned data" in report


def test_every_alert_rule_loads_and_evaluates(prometheus: ManagedProcess, load: list[int]) -> None:
    """Each rule of the chart's rules file runs against the live series without an error (a wrong
    name would only show as an alert that never fires, so evaluation is what can be checked here;
    tests/chart/alerts_test.yaml shows each one firing)."""
    expected = {a.name for a in alerts.alerts(alerts.default_thresholds())}
    deadline = time.monotonic() + _DATA_TIMEOUT_S
    while True:
        with urllib.request.urlopen(prometheus.url + "/api/v1/rules", timeout=10) as response:
            groups = json.loads(response.read())["data"]["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        evaluated = {n for n, r in rules.items() if r.get("lastEvaluation", "").startswith("2")}
        if expected <= evaluated or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert set(rules) == expected
    assert evaluated >= expected, f"not evaluated yet: {sorted(expected - evaluated)}"
    unhealthy = {n: r.get("lastError") for n, r in rules.items() if r["health"] != "ok"}
    assert not unhealthy, unhealthy
    # A healthy fleet under light load: nothing fires but the broken replica's retries.
    firing = {n for n, r in rules.items() if r["state"] == "firing"}
    assert not firing, firing
