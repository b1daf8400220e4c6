"""Figures and ratios from one comparison's results (pure), printed as a Markdown table."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Results = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    label: str
    get: Callable[[dict[str, Any]], float | None]  # from one system's results
    is_higher_better: bool
    digits: int = 1


def _offline(workload: str, field: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda s: s.get("offline", {}).get("workloads", {}).get(workload, {}).get(field)


def _served(run: str, field: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda s: s.get("served", {}).get("runs", {}).get(run, {}).get(field)


METRICS = (
    Metric("W1_offline_tok_s", "W1 offline output tok/s", _offline("W1", "output_throughput"), True),
    Metric("W2_offline_tok_s", "W2 offline output tok/s", _offline("W2", "output_throughput"), True),
    Metric("S1_tpot_ms", "S1 time per output token (ms)", _offline("S1", "tpot_ms"), False, 2),
    Metric("S1_mbu_pct", "S1 model bandwidth utilization (%)", lambda s: s.get("mbu_pct"), True),
    Metric("W1_served_tok_s", "W1 served all at once, tok/s", _served("W1@inf", "output_throughput"), True),
    Metric("W2_served_tok_s", "W2 served all at once, tok/s", _served("W2@inf", "output_throughput"), True),
    Metric("W2_r16_tok_s", "W2 served 16 req/s, tok/s", _served("W2@16", "output_throughput"), True),
    Metric("W2_r16_ttft_p99_ms", "W2 16 req/s TTFT p99 ms", _served("W2@16", "p99_ttft_ms"), False, 0),
    Metric("W2_r16_tpot_median_ms", "W2 16 req/s TPOT median ms", _served("W2@16", "median_tpot_ms"), False),
    Metric("W2_r4_tok_s", "W2 served 4 req/s, tok/s", _served("W2@4", "output_throughput"), True),
    Metric("W2_r4_ttft_p99_ms", "W2 4 req/s TTFT p99 ms", _served("W2@4", "p99_ttft_ms"), False, 0),
    Metric("W2_r4_tpot_median_ms", "W2 4 req/s TPOT median ms", _served("W2@4", "median_tpot_ms"), False),
    Metric("P1_prompt_tok_s", "P1 offline prompt tok/s", _offline("P1", "input_throughput"), True, 0),
)  # fmt: skip

# (metric, baseline, bound, is_min): issues 8 and 21's targets as Corral / baseline ratios.
TARGETS = (
    ("W1_offline_tok_s", "vllm", 1.0, True),
    ("W2_offline_tok_s", "vllm", 1.0, True),
    ("W1_served_tok_s", "vllm", 1.0, True),
    ("W2_served_tok_s", "vllm", 1.0, True),
    ("W2_offline_tok_s", "transformers", 4.0, True),
    ("S1_tpot_ms", "vllm", 1.05, False),
    ("W2_r16_ttft_p99_ms", "vllm", 1.0, False),
    ("W2_r16_tpot_median_ms", "vllm", 1.0, False),
    ("W2_r4_ttft_p99_ms", "vllm", 1.0, False),
    ("W2_r4_tpot_median_ms", "vllm", 1.0, False),
)
RATIO_PAIRS = (("corral", "vllm"), ("corral", "transformers"), ("corral-t213", "vllm"))


def _num(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def figures(results: Results) -> dict[str, dict[str, float | None]]:
    """metric key -> system -> value."""
    systems = results.get("systems", {})
    return {m.key: {name: _num(m.get(s)) for name, s in systems.items()} for m in METRICS}


def ratios(results: Results) -> dict[str, dict[str, float | None]]:
    """metric key -> "a/b" -> a's value divided by b's."""
    fig = figures(results)
    out: dict[str, dict[str, float | None]] = {}
    for m in METRICS:
        row = {}
        for a, b in RATIO_PAIRS:
            va, vb = fig[m.key].get(a), fig[m.key].get(b)
            row[f"{a}/{b}"] = va / vb if va is not None and vb else None
        out[m.key] = row
    return out


def ratio_rounds(results: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """metric key -> "a/b" -> the ratio in each round (`rounds`, else the one run), its median and
    range. Same-run ratios are the only comparable figures, and on these machines one run's ratio
    moves by 5-10 % (TTFT under overload by more), so a target is judged on the median."""
    snapshots = results.get("rounds") or [results.get("systems", {})]
    per_round = [ratios({"systems": systems}) for systems in snapshots]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for m in METRICS:
        row = {}
        for a, b in RATIO_PAIRS:
            pair = f"{a}/{b}"
            values = [v for r in per_round if (v := r[m.key][pair]) is not None]
            if values:
                row[pair] = _spread(values)
        out[m.key] = row
    return out


def _spread(values: list[float]) -> dict[str, Any]:
    return {"ratios": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def target_checks(results: Results) -> list[dict[str, Any]]:
    """Each target against the median of its per-round ratios (the one run's ratio without rounds)."""
    rounds = ratio_rounds(results)
    checks = []
    for key, baseline, bound, is_min in TARGETS:
        r = rounds[key].get(f"corral/{baseline}")
        value = None if r is None else r["median"]
        met = None if value is None else (value >= bound if is_min else value <= bound)
        checks.append(
            {
                "metric": key,
                "vs": baseline,
                "target": f"{'>=' if is_min else '<='} {bound}x",
                "ratio": value,
                "ratios": [] if r is None else r["ratios"],
                "met": met,
            }
        )
    return checks


# Issue 21's target on any CPU: served all at once (streamed) >= 0.95x the same engine offline.
SERVED_OVER_OFFLINE = (
    ("W1", "W1_served_tok_s", "W1_offline_tok_s"),
    ("W2", "W2_served_tok_s", "W2_offline_tok_s"),
)
SERVED_OVER_OFFLINE_TARGET = 0.95


def served_over_offline(results: Results) -> dict[str, dict[str, Any]]:
    """system -> workload -> served / offline output tok/s: per round (`rounds`, each a snapshot of
    `systems`; else the one run), their median and range. Rounds alternate which phase goes
    first, so a machine that drifts over a run moves both sides."""
    snapshots = results.get("rounds") or [results.get("systems", {})]
    out: dict[str, dict[str, Any]] = {}
    for name in results.get("systems", {}):
        per: dict[str, Any] = {}
        for workload, served_key, offline_key in SERVED_OVER_OFFLINE:
            ratios = []
            for systems in snapshots:
                fig = figures({"systems": {name: systems.get(name, {})}})
                served, offline = fig[served_key][name], fig[offline_key][name]
                if served is not None and offline:
                    ratios.append(served / offline)
            if ratios:
                per[workload] = _spread(ratios)
        if per:
            out[name] = per
    return out


def markdown_served_over_offline(results: Results) -> str:
    table = served_over_offline(results)
    if not table:
        return ""
    lines = [
        f"| served / offline (target >= {SERVED_OVER_OFFLINE_TARGET}x) | workload | median | range | each |",
        "|---|---|---|---|---|",
    ]
    for name, per in table.items():
        label = results["systems"][name].get("label", name)
        for workload, r in per.items():
            met = "yes" if r["median"] >= SERVED_OVER_OFFLINE_TARGET else "no"
            lines.append(
                f"| {label} ({met}) | {workload} | {r['median']:.3f}x | {r['min']:.3f}-{r['max']:.3f} "
                f"| {', '.join(f'{x:.3f}' for x in r['ratios'])} |"
            )
    return "\n".join(lines)


def served_cpu_rows(results: Results) -> list[dict[str, Any]]:
    """Per round, system and all-at-once run: the served run's duration against the offline run's,
    the engine's summed step time (Corral exports it), and the CPU that ran beside the steps: the
    server's main thread (its event loop) and the load generator, per output token, and how long
    the busiest threads (the steps') waited for a core."""
    snapshots = results.get("rounds") or [results.get("systems", {})]
    rows = []
    for index, systems in enumerate(snapshots, 1):
        for name, sysres in systems.items():
            offline = sysres.get("offline", {}).get("workloads", {})
            for key, summary in sysres.get("served", {}).get("runs", {}).items():
                workload, _, rate = key.partition("@")
                if rate != "inf" or "output_throughput" not in summary:
                    continue
                tokens = summary.get("total_output_tokens") or 0
                cpu, engine = summary.get("cpu") or {}, summary.get("engine") or {}
                step = engine.get("step_s")
                main = cpu.get("main_thread")
                client = summary.get("client_cpu_s")

                rows.append(
                    {
                        "round": index,
                        "system": results.get("systems", {}).get(name, {}).get("label", name),
                        "workload": workload,
                        "offline_s": offline.get(workload, {}).get("elapsed_s"),
                        "served_s": summary.get("duration_s"),
                        "step_s": step["mean"] * step["count"] if step else None,
                        "main_us_per_token": _per_token_us(main["cpu_s"] if main else None, tokens),
                        "client_us_per_token": _per_token_us(client, tokens),
                        "busiest_wait_s": sum(t["runqueue_s"] for t in cpu.get("busiest", []))
                        if cpu
                        else None,
                    }
                )
    return rows


def _per_token_us(seconds: float | None, tokens: int) -> float | None:
    return 1e6 * seconds / tokens if seconds is not None and tokens else None


def markdown_served_cpu(results: Results) -> str:
    rows = served_cpu_rows(results)
    if not rows:
        return ""
    lines = [
        "| round | system | workload | offline s | served s | served steps s | server main thread "
        "µs/token | client µs/token | step threads waiting for a core, s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            str(r["round"]),
            r["system"],
            r["workload"],
            _fmt(r["offline_s"], 2),
            _fmt(r["served_s"], 2),
            _fmt(r["step_s"], 2),
            _fmt(r["main_us_per_token"], 0),
            _fmt(r["client_us_per_token"], 0),
            _fmt(r["busiest_wait_s"], 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown_table(results: Results) -> str:
    systems = list(results.get("systems", {}))
    labels = [results["systems"][s].get("label", s) for s in systems]
    fig, rat = figures(results), ratios(results)
    pairs = [f"{a}/{b}" for a, b in RATIO_PAIRS if a in systems and b in systems]
    head = ["metric", *labels, *[p.replace("corral-t213", "corral(t2.13)") for p in pairs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METRICS:
        vals = [_fmt(fig[m.key][s], m.digits) for s in systems]
        rs = [_fmt(rat[m.key][p], 2) + ("x" if rat[m.key][p] is not None else "") for p in pairs]
        if all(v == "-" for v in vals):
            continue
        lines.append("| " + " | ".join([m.label, *vals, *rs]) + " |")
    return "\n".join(lines)


def markdown_ratio_rounds(results: Results) -> str:
    """With rounds: every metric's per-round ratios, median and range (the table above is the last
    round's)."""
    if len(results.get("rounds") or []) < 2:
        return ""
    lines = ["| metric (rounds) | pair | median | range | each round |", "|---|---|---|---|---|"]
    labels = {m.key: m.label for m in METRICS}
    for key, row in ratio_rounds(results).items():
        for pair, r in row.items():
            lines.append(
                f"| {labels[key]} | {pair} | {r['median']:.2f}x | {r['min']:.2f}-{r['max']:.2f} "
                f"| {', '.join(f'{x:.2f}' for x in r['ratios'])} |"
            )
    return "\n".join(lines)


def markdown_targets(results: Results) -> str:
    lines = ["| target | Corral / baseline (median of rounds) | each round | met |", "|---|---|---|---|"]
    for c in target_checks(results):
        met = "-" if c["met"] is None else ("yes" if c["met"] else "no")
        each = ", ".join(f"{x:.2f}" for x in c["ratios"]) or "-"
        lines.append(f"| {c['metric']} vs {c['vs']} {c['target']} | {_fmt(c['ratio'], 2)} | {each} | {met} |")
    return "\n".join(lines)


def failures(results: Results) -> str:
    """What did not run, per system and phase (empty when everything ran)."""
    lines = []
    for name, sysres in results.get("systems", {}).items():
        if "error" in sysres:
            lines.append(f"- {name}: {sysres['error']}")
        for phase in ("offline", "served"):
            part = sysres.get(phase, {})
            if "error" in part:
                lines.append(f"- {name} {phase}: {part['error']}")
            for run, summary in part.get("runs", {}).items():
                if "error" in summary:
                    lines.append(f"- {name} {phase} {run}: {summary['error']}")
    return "Failures:\n" + "\n".join(lines) if lines else ""
