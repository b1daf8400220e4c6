"""See the dashboards' queries return data without Grafana: a Prometheus config for a local fleet, and
every dashboard query run against Prometheus' HTTP API.

    python -m corral_cli.chartgen.promcheck scrape-config --gateway http://127.0.0.1:8000 > prometheus.yml
    prometheus --config.file=prometheus.yml --web.listen-address=127.0.0.1:9090 --storage.tsdb.path=DIR
    python -m corral_cli.chartgen.promcheck check --prometheus http://127.0.0.1:9090 --model demo
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from corral_cli.chartgen.queries import Query, dashboard_queries

log = logging.getLogger(__name__)
_TIMEOUT_S = 10.0
# Never send local traffic through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PromCheckError(RuntimeError):
    """Prometheus or the gateway could not be reached or answered an error."""


@dataclass(frozen=True, slots=True)
class QueryResult:
    query: Query
    num_series: int
    sample: float | None  # the first series' value, for a glance


def _target(url: str) -> str:
    """http://127.0.0.1:8100 -> 127.0.0.1:8100 (Prometheus static targets are host:port)."""
    parsed = urllib.parse.urlsplit(url)
    return parsed.netloc or url


def scrape_config(gateway_url: str, engine_urls: Sequence[str], interval: str = "5s") -> dict[str, Any]:
    """A Prometheus config scraping one gateway and its engines, as the chart's monitors would."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": "corral-gateway", "static_configs": [{"targets": [_target(gateway_url)]}]},
            {
                "job_name": "corral-engines",
                "static_configs": [{"targets": sorted(_target(u) for u in engine_urls)}],
            },
        ],
    }


def _get_json(url: str, api_key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with _OPENER.open(urllib.request.Request(url, headers=headers), timeout=_TIMEOUT_S) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise PromCheckError(f"GET {url} failed: {e}") from e


def engine_urls(gateway_url: str, api_key: str | None = None) -> list[str]:
    """Every replica URL the gateway routes to (its /corral/replicas endpoint, which needs a key
    when the gateway checks keys)."""
    models = _get_json(gateway_url.rstrip("/") + "/corral/replicas", api_key).get("models") or {}
    return sorted({r["url"] for replicas in models.values() for r in replicas})


def instant_query(prometheus_url: str, expr: str) -> list[dict[str, Any]]:
    url = prometheus_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = _get_json(url)
    if body.get("status") != "success":
        raise PromCheckError(f"query failed: {body.get('error')}: {expr}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def check_dashboards(prometheus_url: str, model: str, rate_interval: str = "1m") -> list[QueryResult]:
    out = []
    for q in dashboard_queries(model=model, rate_interval=rate_interval):
        series = instant_query(prometheus_url, q.expr)
        sample = float(series[0]["value"][1]) if series else None
        out.append(QueryResult(q, len(series), sample))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral_cli.chartgen.promcheck", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("scrape-config", help="print a Prometheus config for a local fleet")
    config.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's base URL")
    config.add_argument("--interval", default="5s", help="scrape interval (default: 5s)")
    config.add_argument(
        "--api-key",
        default=os.environ.get("CORRAL_API_KEY"),
        help="a gateway API key, when it checks keys (default: $CORRAL_API_KEY, else none)",
    )
    check = sub.add_parser(
        "check", help="run every dashboard query; exit 1 if one returns nothing (event panels excepted)"
    )
    check.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    check.add_argument("--model", default=".*", help="the $model variable (default: every model)")
    check.add_argument("--rate-interval", default="1m", help="the $__rate_interval variable")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "scrape-config":
            urls = engine_urls(args.gateway, args.api_key)
            text = yaml.safe_dump(scrape_config(args.gateway, urls, args.interval))
            sys.stdout.write(text)
            return 0
        results = check_dashboards(args.prometheus, args.model, args.rate_interval)
    except PromCheckError as e:
        log.error("%s", e)
        return 2
    for r in results:
        if r.sample is not None:
            value = f"{r.num_series} series, first = {r.sample:.4g}"
        else:
            value = "no data (none happened yet)" if r.query.is_event_driven else "NO DATA"
        sys.stdout.write(f"{r.query.dashboard:24} {r.query.panel[:40]:40} {r.query.legend[:30]:30} {value}\n")
    empty = [r for r in results if r.num_series == 0]
    sys.stdout.write(f"{len(results) - len(empty)} of {len(results)} queries returned data\n")
    return 1 if any(not r.query.is_event_driven for r in empty) else 0


if __name__ == "__main__":
    sys.exit(main())
