"""A fresh fleet shows zeros, not "No data": every metric a dashboard queries has a series at start.

One `corral engine` process and a `corral gateway` process in front of it, no request sent; both
/metrics pages are parsed with prometheus-client and each dashboard metric must have a sample.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from corral_cli.chartgen.queries import HISTOGRAM_SUFFIXES, dashboard_queries, metric_names
from corral_engine.wire import LORA_REQUESTS_INFO, SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL
from corral_gateway.metrics import ADAPTER_ROUTES_TOTAL, KEY_TOKENS_TOTAL
from prometheus_client.parser import text_string_to_metric_families

from e2e.procs import HOST, EngineProcess, ManagedProcess, free_port, start_engine

pytestmark = [pytest.mark.e2e]

MODEL = "tiny-llama"
# Dashboard metrics that cannot have a series on a fresh fleet, each with why. Every panel reads the
# engine or the gateway directly (no recording rules, no kube-state-metrics), but:
NOT_ON_A_FRESH_FLEET: frozenset[str] = frozenset(
    {
        KEY_TOKENS_TOTAL,  # labelled by API key name: none without a keys file (this fleet has none)
        # A series per draft position only with --speculative (this engine runs without).
        SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL,
        LORA_REQUESTS_INFO,  # only with --enable-lora (this engine runs without)
        # Zero series only for a pool serving adapters (this engine runs without LoRA).
        ADAPTER_ROUTES_TOTAL,
    }
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    with start_engine(tiny_model_dir, served_model_name=MODEL, num_threads=1) as process:
        yield process


@pytest.fixture(scope="module")
def gateway(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    port = free_port()
    argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", HOST, "--port", str(port)]
    argv += ["--backend", f"{MODEL}={engine.url}"]
    with ManagedProcess(argv, port, name="gateway", log_dir=tmp_path_factory.mktemp("gateway")) as gw:
        gw.wait_ready(60)
        yield gw


def _sample_names(process: ManagedProcess) -> set[str]:
    """Names of the samples one scrape holds (a family declared without any series has none)."""
    families = text_string_to_metric_families(process.metrics_text())
    return {sample.name for family in families for sample in family.samples}


def test_every_dashboard_metric_has_a_series_before_any_request(
    engine: EngineProcess, gateway: ManagedProcess
) -> None:
    exported = _sample_names(engine) | _sample_names(gateway)
    queried = set().union(*(metric_names(q.expr) for q in dashboard_queries()))
    assert queried, "no metric found in the dashboards' queries"
    missing = {
        name
        for name in queried - NOT_ON_A_FRESH_FLEET
        if name not in exported and not any(name + suffix in exported for suffix in HISTOGRAM_SUFFIXES)
    }
    assert not missing, f"dashboard metrics without a series on a fresh fleet: {sorted(missing)}"
