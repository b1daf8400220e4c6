"""The chart generator's command and the promcheck helpers, without a cluster or Prometheus."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from corral_cli.chartgen import promcheck
from corral_cli.chartgen.__main__ import main as chartgen_main
from corral_cli.chartgen.files import CHART, generated_files

from tests.chart.conftest import ROOT


def test_check_reports_drift_and_generation_fixes_it(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "crds", tmp_path / "crds")
    assert chartgen_main(["--check", "--root", str(tmp_path)]) == 1  # nothing generated yet
    assert chartgen_main(["--root", str(tmp_path)]) == 0
    assert chartgen_main(["--check", "--root", str(tmp_path)]) == 0
    schema = tmp_path / CHART / "values.schema.json"
    schema.write_text(schema.read_text().replace('"minimum": 1', '"minimum": 0', 1))
    assert chartgen_main(["--check", "--root", str(tmp_path)]) == 1


def test_generated_files_cover_dashboards_schema_rbac_and_crds() -> None:
    names = {path.name for path in generated_files(ROOT)}
    assert {"corral-fleet.json", "corral-deployment.json", "values.schema.json"} <= names
    assert {"_operator-rules.tpl", "corral.dev_llmdeployments.yaml", "kopf.dev_peerings.yaml"} <= names


def test_scrape_config_targets_host_and_port() -> None:
    config = promcheck.scrape_config(
        "http://127.0.0.1:8000", ["http://127.0.0.1:8102", "http://127.0.0.1:8101"], interval="1s"
    )
    assert config["global"]["scrape_interval"] == "1s"
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert jobs == {
        "corral-gateway": ["127.0.0.1:8000"],
        "corral-engines": ["127.0.0.1:8101", "127.0.0.1:8102"],
    }


def test_check_fails_cleanly_when_prometheus_is_unreachable() -> None:
    # A port nothing listens on: bind, read the port, close.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert promcheck.main(["check", "--prometheus", f"http://127.0.0.1:{port}"]) == 2
