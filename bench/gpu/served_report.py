"""Side by side: the served phase of several acceptance runs (served_ab.sh's four: each arm cold
and warm), one row per run and rate, and a chart of the latency tails.

    python3 -m bench.gpu.served_report /tmp/ab            # every */gpu-acceptance.json with a served phase
    python3 -m bench.gpu.served_report RUN_DIR... --out DIR

Writes `served-ab.md` (the table, also printed), `served-ab.json` (the rows) and `served-ab.png`
(TTFT and TPOT p99 per run and rate) into --out (default: the first directory given).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from bench.gpu.acceptance import RESULT_FILE

log = logging.getLogger("gpu")


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories holding a served phase: the paths themselves, or their subdirectories."""
    found = []
    for path in paths:
        candidates = (
            [path]
            if (path / RESULT_FILE).is_file()
            else sorted(p.parent for p in path.glob(f"*/{RESULT_FILE}"))
        )
        for run in candidates:
            phases = json.loads((run / RESULT_FILE).read_text()).get("phases", {})
            served = phases.get("served")
            if served and "rates" in served:
                found.append(run)
    return found


def rows(runs: list[Path]) -> list[dict[str, Any]]:
    """One row per run and rate, runs in the order `find_runs` gave them (a directory's runs by
    name: served_ab.sh's A-cold, A-warm, B-cold, B-warm)."""
    out = []
    for run in runs:
        served = json.loads((run / RESULT_FILE).read_text())["phases"]["served"]
        settings = dict(
            part.split("=", 1) for part in str(served.get("settings", "")).split(", ") if "=" in part
        )
        for rate, f in served["rates"].items():
            steps = f.get("steps", {})
            out.append(
                {
                    "run": run.name,
                    "async_scheduling": settings.get("async_scheduling", "?"),
                    "engine_start_s": served.get("engine", {}).get("start_s"),
                    "rate": float(rate),
                    "ttft_p50_ms": f["ttft_ms"]["p50"],
                    "ttft_p99_ms": f["ttft_ms"]["p99"],
                    "tpot_p50_ms": f["tpot_ms"]["p50"],
                    "tpot_p99_ms": f["tpot_ms"]["p99"],
                    "output_tok_s": f["output_throughput"],
                    "steps": {k: (v["count"], v["mean_ms"]) for k, v in steps.items()},
                    "kernel_variants_compiled": f.get("kernel_variants_compiled"),
                }
            )
    return out


def table(data: list[dict[str, Any]]) -> str:
    lines = [
        "| run | async | start s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | tok/s "
        "| steps: count x mean ms | variants compiled |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in data:
        steps = ", ".join(f"{k} {n} x {ms:.1f}" for k, (n, ms) in r["steps"].items() if n)
        start = "-" if r["engine_start_s"] is None else f"{r['engine_start_s']:.1f}"
        variants = "-" if r["kernel_variants_compiled"] is None else str(r["kernel_variants_compiled"])
        lines.append(
            f"| {r['run']} | {r['async_scheduling']} | {start} | {r['rate']:g} "
            f"| {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} "
            f"| {r['tpot_p50_ms']:.2f} / {r['tpot_p99_ms']:.2f} "
            f"| {r['output_tok_s']:.0f} | {steps} | {variants} |"
        )
    return "\n".join(lines)


def plot(data: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(r["run"] for r in data))
    rates = sorted({r["rate"] for r in data})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(runs))
    for ax, key, label in (
        (axes[0], "ttft_p99_ms", "TTFT p99, ms"),
        (axes[1], "tpot_p99_ms", "TPOT p99, ms"),
    ):
        for i, run in enumerate(runs):
            by_rate = {r["rate"]: r[key] for r in data if r["run"] == run}
            xs = [j + i * width for j in range(len(rates))]
            bars = ax.bar(xs, [by_rate.get(rate, 0.0) for rate in rates], width, label=run)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(
            [j + width * (len(runs) - 1) / 2 for j in range(len(rates))], [f"{r:g} req/s" for r in rates]
        )
        ax.set_ylabel(label)
        ax.set_title(f"W2 served: {label}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, or directories holding them")
    parser.add_argument(
        "--out", type=Path, help="where the table, JSON and chart go (default: the first path)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    runs = find_runs(args.paths)
    if not runs:
        log.error("no served phase under %s", ", ".join(map(str, args.paths)))
        return 1
    data = rows(runs)
    out = args.out or args.paths[0]
    out.mkdir(parents=True, exist_ok=True)
    text = table(data)
    (out / "served-ab.md").write_text(text + "\n")
    (out / "served-ab.json").write_text(json.dumps(data, indent=1))
    plot(data, out / "served-ab.png")
    log.info("%s\nwrote served-ab.md, served-ab.json and served-ab.png to %s", text, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
