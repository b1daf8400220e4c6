"""Where the autoscaler's load comes from: a small MetricsSource protocol and its implementations.

PodScrapeSource reads the engines' Prometheus /metrics (vLLM metric names, which the bundled engine
also exports); FileSource reads a JSON file, for demos and tests that feed load by hand.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from corral_engine import wire
from prometheus_client.parser import text_string_to_metric_families

from corral_operator.autoscaler import Load

log = logging.getLogger(__name__)

MAX_PARALLEL_SCRAPES = 8
_WANTED = (
    wire.NUM_REQUESTS_WAITING,
    wire.NUM_REQUESTS_RUNNING,
    wire.KV_CACHE_USAGE_PERC,
    wire.REQUEST_SUCCESS_TOTAL,  # activity between two scrapes (the autoscaler's idle time)
)


@dataclass(frozen=True, slots=True)
class PodTarget:
    name: str
    ip: str
    port: int


class MetricsSource(Protocol):
    def load(self, namespace: str, name: str, targets: Sequence[PodTarget]) -> Load | None:
        """Load over the ready pods `targets` of LLMDeployment namespace/name; None if unknown."""
        ...


def parse_gauges(text: str) -> dict[str, float]:
    """The wanted series of one pod's Prometheus text exposition, over their label sets: requests
    (waiting, running, finished) summed, KV usage the fullest (a vLLM pod with --data-parallel-size
    exports a ratio per engine, `engine="0"`, `engine="1"`: their sum is no ratio; the gateway takes
    the max too); {} if it does not parse."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == wire.KV_CACHE_USAGE_PERC:
                    out[sample.name] = max(out.get(sample.name, 0.0), sample.value)
                elif sample.name in _WANTED:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    except ValueError:
        return {}
    return out


def aggregate(per_pod: Sequence[dict[str, float]]) -> Load | None:
    """Sum waiting/running, average KV usage over the pods that answered (one entry per pod asked;
    an empty one did not answer)."""
    answered = [g for g in per_pod if wire.KV_CACHE_USAGE_PERC in g or wire.NUM_REQUESTS_WAITING in g]
    if not answered:
        return None
    return Load(
        num_waiting=sum(g.get(wire.NUM_REQUESTS_WAITING, 0.0) for g in answered),
        num_running=sum(g.get(wire.NUM_REQUESTS_RUNNING, 0.0) for g in answered),
        kv_usage_ratio=sum(g.get(wire.KV_CACHE_USAGE_PERC, 0.0) for g in answered) / len(answered),
        num_reporting=len(answered),
        num_unreported=len(per_pod) - len(answered),
        num_finished=sum(g.get(wire.REQUEST_SUCCESS_TOTAL, 0.0) for g in answered),
    )


class PodScrapeSource:
    """Scrapes http://POD_IP:PORT/metrics of each ready pod; pods outside `allowed_networks` are skipped."""

    def __init__(
        self,
        timeout_s: float = 2.0,
        allowed_networks: Sequence[str] = ("0.0.0.0/0", "::/0"),
    ) -> None:
        self._timeout_s = timeout_s
        self._networks = [ipaddress.ip_network(n) for n in allowed_networks]
        self._unreachable: set[tuple[str, str]] = set()  # deployments none of whose pods answered

    def _is_allowed(self, ip: str) -> bool:
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(address in net for net in self._networks if net.version == address.version)

    def _scrape(self, target: PodTarget) -> dict[str, float]:
        host = f"[{target.ip}]" if ":" in target.ip else target.ip
        url = f"http://{host}:{target.port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=self._timeout_s) as response:
                return parse_gauges(response.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            log.debug("scrape of pod %s failed: %s", target.name, e)
            return {}

    def load(self, namespace: str, name: str, targets: Sequence[PodTarget]) -> Load | None:
        allowed = [t for t in targets if self._is_allowed(t.ip)]
        if len(allowed) < len(targets):
            log.warning(
                "%s/%s: not scraping %d pods outside the allowed networks",
                namespace,
                name,
                len(targets) - len(allowed),
            )
        if len(allowed) <= 1:
            load = aggregate([self._scrape(t) for t in allowed])
        else:
            # In parallel, so one slow pod costs one timeout per tick, not one per pod.
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SCRAPES, len(allowed))) as pool:
                load = aggregate(list(pool.map(self._scrape, allowed)))
        self._note_reachability(namespace, name, allowed, load is not None)
        return load

    def _note_reachability(self, namespace: str, name: str, targets: Sequence[PodTarget], ok: bool) -> None:
        """Say so (once, not every tick) when no pod's /metrics answers: autoscaling then holds."""
        key = (namespace, name)
        if ok or not targets:
            if key in self._unreachable:
                self._unreachable.discard(key)
                log.info("%s/%s: pods' /metrics answer again", namespace, name)
            return
        if key not in self._unreachable:
            self._unreachable.add(key)
            log.warning(
                "%s/%s: none of %d ready pods answered http://POD_IP:%d/metrics with engine gauges; "
                "status.load stays unknown and builtin autoscaling holds the replica count until one "
                "does (a NetworkPolicy, or the wrong port?)",
                namespace,
                name,
                len(targets),
                targets[0].port,
            )


class FileSource:
    """Load from a JSON file: {"NAMESPACE/NAME": {"waiting": 40, "running": 4, "kvUsage": 0.9}}."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def load(self, namespace: str, name: str, targets: Sequence[PodTarget]) -> Load | None:
        try:
            entries = json.loads(self._path.read_text())
        except (OSError, ValueError) as e:
            log.warning("metrics file %s unreadable: %s", self._path, e)
            return None
        entry = entries.get(f"{namespace}/{name}") if isinstance(entries, dict) else None
        if not isinstance(entry, dict) or not targets:
            return None
        return Load(
            num_waiting=float(entry.get("waiting", 0)),
            num_running=float(entry.get("running", 0)),
            kv_usage_ratio=float(entry.get("kvUsage", 0)),
            num_reporting=len(targets),
        )
