"""Corral's and vLLM's engine step at the same composition, side by side: D decodes plus prompt
chunks, and the whole W2 workload replayed at a request rate straight into each engine (no HTTP).

    .venv/bin/python bench/engine/mixed_step.py [--rounds 3] [--decodes 40,128] \
        [--prompts 0,2000,8x250,12x160] [--replay-rate 16] [--out-dir DIR]

Issue 21's time to first token under arrival traffic is set by the steps that carry prompts: at
16 req/s every step while requests arrive spends the whole 2,048-token budget (D decodes and
several prompts), so a prompt waits about one and a half of them. This times those steps in each
engine's own process (its `step()`: schedule, forward, sample, outputs), rounds alternating which
engine goes first, and replays W2 at the rate with each step's composition and duration, so a
TTFT gap can be read as step speed or as scheduling. Requests sample at `--temperature` (default
1, both engines' default). Writes results.json, table.md and a PNG.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import systems
from compare import ensure_model, machine_info, write_workloads
from mixed_step_worker import replay_summary

log = logging.getLogger("mixed_step")
HERE = Path(__file__).resolve().parent
ENGINES = ("corral", "vllm")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decodes", default="40,128")
    p.add_argument("--prompts", default="0,2000,8x250,12x160", help="P or NxP (N prompts of P tokens)")
    p.add_argument("--repeats", type=int, default=4, help="timed steps per composition and round")
    p.add_argument("--replay-rate", type=float, default=16.0, help="0: no replay")
    p.add_argument("--temperature", type=float, default=1.0, help="every request's (1: the engines' default)")
    p.add_argument("--out-dir", type=Path)
    return p.parse_args()


def run_worker(system: systems.System, model: Path, out: Path, extra: list[str]) -> dict[str, Any] | None:
    cmd = [str(system.python), str(HERE / "mixed_step_worker.py"), "--engine", system.name.split("-")[0]]
    cmd += ["--model", str(model), "--out", str(out), *extra]
    env = system.full_env()
    if system.name == "vllm":
        env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("["):
            log.info("%s", line)
    if proc.returncode != 0 or not out.exists():
        log.warning("%s failed (exit %d): %s", system.name, proc.returncode, proc.stderr.strip()[-600:])
        return None
    log.info("%s done in %.0f s", system.name, time.monotonic() - t0)
    return dict(json.loads(out.read_text()))


def summarise(results: dict[str, Any]) -> str:
    """Median step ms per composition for each engine over all rounds, and Corral / vLLM per round."""
    lines = ["| decodes | prompts | Corral ms | vLLM ms | Corral / vLLM (median of rounds) | each round |"]
    lines.append("|---|---|---|---|---|---|")
    comps = sorted(
        {(s["decodes"], s["prompt"]) for r in results["steps"] for e in r.values() for s in e["steps"]},
        key=lambda c: (c[0], str(c[1])),
    )

    def median(engine: str, rnd: dict[str, Any], comp: tuple[int, str]) -> float | None:
        ms = [s["ms"] for s in rnd.get(engine, {}).get("steps", []) if (s["decodes"], s["prompt"]) == comp]
        return statistics.median(ms) if ms else None

    def fmt(values: list[float], pattern: str) -> str:
        return pattern.format(statistics.median(values)) if values else "-"

    for comp in comps:
        per = [(median("corral", r, comp), median("vllm", r, comp)) for r in results["steps"]]
        ratios = [c / v for c, v in per if c and v]
        cs, vs = [c for c, _ in per if c], [v for _, v in per if v]
        each = ", ".join(f"{x:.3f}" for x in ratios)
        lines.append(
            f"| {comp[0]} | {comp[1]} | {fmt(cs, '{:.1f}')} | {fmt(vs, '{:.1f}')} | {fmt(ratios, '{:.3f}x')} "
            f"| {each} |"
        )
    for rnd in results.get("replays", []):
        for engine in ENGINES:
            rep = rnd.get(engine)
            if rep:
                lines.append(f"\nreplay {engine}: {rep['summary']}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for engine, color in zip(ENGINES, ("tab:blue", "tab:orange"), strict=True):
        for i, rnd in enumerate(results["replays"]):
            rep = rnd.get(engine)
            if not rep:
                continue
            xs = [s["start"] for s in rep["steps"]]
            ys = [s["ms"] for s in rep["steps"]]
            ax.plot(xs, ys, color=color, alpha=0.7, lw=0.8, label=engine if i == 0 else None)
    ax.set_xlabel("seconds into the replay")
    ax.set_ylabel("step ms")
    ax.set_title(f"W2 replayed at {results['replay_rate']:g} req/s: each engine step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args()
    out_dir = (
        args.out_dir
        or HERE.parent / "results" / f"mixed-step-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model()
    settings = systems.Settings()
    engines = {name: systems.build(name, settings) for name in ENGINES}
    workloads = write_workloads(["W2"], model, out_dir, quick=False, rates=[])["offline"]
    results: dict[str, Any] = {
        "machine": machine_info(),
        "replay_rate": args.replay_rate,
        "steps": [],
        "replays": [],
    }
    step_args = ["--decodes", args.decodes, "--prompts", args.prompts, "--repeats", str(args.repeats)]
    step_args += ["--temperature", str(args.temperature)]
    for rnd in range(args.rounds):
        order = ENGINES if rnd % 2 == 0 else ENGINES[::-1]
        steps: dict[str, Any] = {}
        replays: dict[str, Any] = {}
        for name in order:
            log.info("round %d/%d: %s, fixed compositions", rnd + 1, args.rounds, name)
            got = run_worker(engines[name], model, out_dir / f"steps-{name}-{rnd}.json", step_args)
            if got:
                steps[name] = got
            if args.replay_rate > 0:
                log.info(
                    "round %d/%d: %s, W2 replayed at %g req/s", rnd + 1, args.rounds, name, args.replay_rate
                )
                extra = ["--replay", str(workloads["W2"]), "--rate", str(args.replay_rate)]
                extra += ["--temperature", str(args.temperature)]
                rep = run_worker(engines[name], model, out_dir / f"replay-{name}-{rnd}.json", extra)
                if rep:
                    rep["summary"] = replay_summary(rep)
                    log.info("%s replay: %s", name, rep["summary"])
                    replays[name] = rep
        results["steps"].append(steps)
        results["replays"].append(replays)
        (out_dir / "results.json").write_text(json.dumps(results))
    table = summarise(results)
    (out_dir / "table.md").write_text(table + "\n")
    sys.stdout.write(table + "\n")
    if args.replay_rate > 0:
        plot(results, out_dir / "replay-steps.png")
    log.info("results in %s", out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
