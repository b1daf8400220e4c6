"""Replica load samples read from an engine's /metrics (vLLM names) or its response load headers, and
its LoRA adapter state (vLLM's `vllm:lora_requests_info`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from corral_engine import wire
from prometheus_client.parser import text_string_to_metric_families

# vLLM before v1 exported KV usage as gpu_cache_usage_perc; read either so older vLLMs work too.
_LEGACY_KV_USAGE = "vllm:gpu_cache_usage_perc"
_WANTED = (wire.NUM_REQUESTS_RUNNING, wire.NUM_REQUESTS_WAITING, wire.KV_CACHE_USAGE_PERC, _LEGACY_KV_USAGE)
# Filter lines before the (pure Python, slowish) parser; histograms dominate a /metrics page.
_LINE_PREFIXES = tuple(_WANTED) + tuple(f"# {kind} {name}" for kind in ("HELP", "TYPE") for name in _WANTED)


_LORA_LINES = (wire.LORA_REQUESTS_INFO, f"# TYPE {wire.LORA_REQUESTS_INFO} ")


@dataclass(frozen=True, slots=True)
class LoraState:
    """The adapters a replica's running and waiting requests use, and how many one step may run
    (None: not said). Names as the engine's `/v1/models` lists them."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_lora: int | None

    @property
    def active(self) -> frozenset[str]:
        return self.running | self.waiting


@dataclass(frozen=True, slots=True)
class LoadSample:
    num_running: float
    num_waiting: float
    kv_usage_ratio: float  # 0-1
    at_s: float  # monotonic time the sample was taken


def parse_metrics_text(text: str, at_s: float) -> LoadSample | None:
    """Sum running/waiting over model labels, take the max KV usage; None if the gauges are absent."""
    wanted_lines = [line for line in text.splitlines() if line.startswith(_LINE_PREFIXES)]
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families("\n".join(wanted_lines) + "\n"):
            for sample in family.samples:
                if sample.name not in _WANTED:
                    continue
                if sample.name in (wire.KV_CACHE_USAGE_PERC, _LEGACY_KV_USAGE):
                    totals[wire.KV_CACHE_USAGE_PERC] = max(
                        totals.get(wire.KV_CACHE_USAGE_PERC, 0.0), sample.value
                    )
                else:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError:
        return None
    if wire.NUM_REQUESTS_RUNNING not in totals and wire.NUM_REQUESTS_WAITING not in totals:
        return None
    return LoadSample(
        num_running=totals.get(wire.NUM_REQUESTS_RUNNING, 0.0),
        num_waiting=totals.get(wire.NUM_REQUESTS_WAITING, 0.0),
        kv_usage_ratio=min(1.0, max(0.0, totals.get(wire.KV_CACHE_USAGE_PERC, 0.0))),
        at_s=at_s,
    )


def parse_load_headers(headers: Mapping[str, str], at_s: float) -> LoadSample | None:
    """The engine's load headers on any response; None when absent or malformed."""
    try:
        running = headers.get(wire.HEADER_NUM_RUNNING)
        waiting = headers.get(wire.HEADER_NUM_WAITING)
        if running is None or waiting is None:
            return None
        kv = float(headers.get(wire.HEADER_KV_USAGE) or 0.0)
        return LoadSample(float(running), float(waiting), min(1.0, max(0.0, kv)), at_s)
    except ValueError:
        return None


def parse_lora_info(text: str) -> LoraState | None:
    """The latest `vllm:lora_requests_info` series of a /metrics page; None when it has none (LoRA
    off, or not vLLM's metric). vLLM keeps a series per state it has been in, each valued the Unix
    time it was last set, so the highest value is the state now; label order does not matter and
    an empty label lists no adapter."""
    lines = [line for line in text.splitlines() if line.startswith(_LORA_LINES)]
    if not lines:
        return None
    latest: dict[str, str] | None = None
    latest_value = -math.inf
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name == wire.LORA_REQUESTS_INFO and sample.value >= latest_value:
                    latest, latest_value = sample.labels, sample.value
    except ValueError:
        return None
    if latest is None:
        return None
    max_lora = latest.get(wire.LORA_MAX_LABEL, "").strip()
    return LoraState(
        running=_names(latest.get(wire.LORA_RUNNING_LABEL, "")),
        waiting=_names(latest.get(wire.LORA_WAITING_LABEL, "")),
        max_lora=int(max_lora) if max_lora.isdigit() else None,
    )


def _names(label: str) -> frozenset[str]:
    return frozenset(name for name in (part.strip() for part in label.split(",")) if name)
