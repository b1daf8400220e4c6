"""Engine speed, side by side in one run (issue 8): Corral vs vLLM's CPU build vs transformers.

    .venv/bin/python bench/engine/compare.py [--only corral,transformers,vllm,corral-t213]
        [--workloads W1,W2,S1[,P1]] [--quick] [--publish]

Builds the `small` demo model, creates the baselines' venvs (reused when present), writes the
workloads once as token-id JSONL, then runs every system as a subprocess with a timeout: offline
(each one's Python API) for all systems, then served (HTTP, streaming, `corral bench`). Prints a table
with ratios and writes results.json + PNGs to --out-dir; --publish also writes them into docs/.
With --paired, each workload's offline and served runs go back to back instead (per system, a
fresh worker and server per workload), so served / offline compares runs seconds apart.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import envs
import membw
import plots
import report
import runner
import workloads
from systems import ALL_SYSTEMS, Settings, System, build

log = logging.getLogger("compare")
REPO = envs.REPO_ROOT
MODEL_DIR = envs.CACHE_DIR / "model-small"
SERVED_RUNS = (
    ("W1", "inf", 1),
    ("W2", "inf", 1),
    ("W2", "16", 2),
    ("W2", "4", 3),
)  # (workload, rate, variant)
S1_MEAN_CONTEXT = 128 + 256 / 2  # prompt + half the output: the mean context a batch-1 decode reads


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(ALL_SYSTEMS), help=f"systems, from {','.join(ALL_SYSTEMS)}")
    p.add_argument("--workloads", default="W1,W2,S1")
    p.add_argument("--quick", action="store_true", help="few short requests: a smoke run in minutes")
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--no-served", action="store_true")
    p.add_argument("--rates", default="inf,16,4", help="served W2 request rates (W1 is always all at once)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--hf-batch-sizes", default="8,16,32", help="transformers static batch sizes (W1)")
    p.add_argument("--hf-w2-batch-sizes", default="16", help="... on W2 (5-10 minutes each)")
    p.add_argument(
        "--hf-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="transformers' dtype (float32: its faster one on CPUs without native bf16; Corral stays bf16)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="Corral's and vLLM's sampling temperature, offline and served (default 0: greedy; "
        "transformers stays greedy)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the offline and served phases, alternating which goes first; served / offline "
        "per round and their median (the machine drifts by 5-10%% over a run)",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="per workload, each system's offline run and its served runs back to back (a fresh worker "
        "and server for each), the order flipped every round: served / offline then compares runs "
        "seconds apart instead of minutes (the machine drifts by 5-15%% over minutes)",
    )
    p.add_argument(
        "--corral-flags",
        default="",
        help="more `corral engine` flags for Corral's served runs, one string (e.g. "
        '"--stream-interval 4"); its offline runs take none',
    )
    p.add_argument("--offline-timeout", type=float, default=1500.0, help="seconds per system")
    p.add_argument("--served-timeout", type=float, default=600.0, help="seconds per corral bench run")
    p.add_argument("--out-dir", type=Path, help="default: bench/results/engine-<UTC time>")
    p.add_argument("--publish", action="store_true", help="also write docs/engine-speed.json and docs/plots/")
    p.add_argument(
        "--from-results",
        type=Path,
        help="only rebuild table, ratios and plots from a results.json (cut-short run)",
    )
    return p.parse_args()


def ensure_model() -> Path:
    if not (MODEL_DIR / "config.json").is_file():
        log.info("writing the small demo model to %s", MODEL_DIR)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "corral_cli.main",
                "demo-model",
                str(MODEL_DIR),
                "--preset",
                "small",
                "--quiet",
            ],
            check=True,
        )
    return MODEL_DIR


def write_workloads(names: list[str], model: Path, out_dir: Path, quick: bool, rates: list[str]) -> dict:
    """Offline files (variant 0) and one fresh-content file per served run, identical for every system."""
    wl_dir = out_dir / "workloads"
    offline, served, meta = {}, [], {}
    for name in names:
        records = workloads.build(name, model, quick=quick)
        offline[name] = workloads.write(records, wl_dir / f"{name}.jsonl")
        meta[name] = workloads.summary(records)
    for name, rate, variant in SERVED_RUNS:
        if name not in names or (name == "W2" and rate not in rates):
            continue
        records = workloads.build(name, model, quick=quick, variant=variant)
        path = workloads.write(records, wl_dir / f"{name}-v{variant}.jsonl")
        served.append(runner.ServedRun(f"{name}@{rate}", path, len(records), rate))
    return {"offline": offline, "served": served, "meta": meta}


def machine_info() -> dict[str, Any]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in ln
        ),
        "?",
    )
    return {"cpu": cpu, "num_cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), **_git_state()}


def _git_state() -> dict[str, Any]:
    """The engine code measured: the lead changes it concurrently, so record the commit and dirtiness."""

    def git(*a: str) -> str:
        proc = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, check=False)
        return proc.stdout.strip()

    return {
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "engine_dirty": bool(git("status", "--porcelain", "engine")),
    }


def measure_bandwidth(out_dir: Path, threads: int) -> dict[str, Any]:
    out = out_dir / "membw.json"
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("membw.py")),
        "--threads",
        str(threads),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, timeout=300)
    return dict(json.loads(out.read_text()))


def add_mbu(results: dict[str, Any], model: Path) -> None:
    need = membw.decode_bytes_per_token(model, S1_MEAN_CONTEXT)
    results["decode_bytes_batch1"] = need
    bandwidth = results.get("bandwidth", {}).get("copy_gb_s_best")
    for sysres in results["systems"].values():
        tpot = sysres.get("offline", {}).get("workloads", {}).get("S1", {}).get("tpot_ms")
        if tpot and bandwidth:
            m = membw.mbu(need["bytes_per_token"], tpot, bandwidth)
            sysres["mbu_pct"] = 100 * m["mbu"]
            sysres["achieved_gb_s"] = m["achieved_gb_s"]


def _phase(results: dict, name: str, system: System | None, phase: str, fn: Any, merge: bool = False) -> None:
    """Run one system's offline or served phase into its entry; with `merge`, its workloads (offline)
    or runs (served) join those an earlier call of this round put there (`--paired`)."""
    entry = results["systems"].setdefault(name, {"label": system.label if system else name})
    if system is None:
        return
    load = os.getloadavg()[0]
    log.info("== %s %s (load %.2f)", name, phase, load)
    new = fn(system)
    new["loadavg_1m_before"] = load
    new["loadavg_1m_after"] = os.getloadavg()[0]
    earlier = entry.get(phase) if merge else None
    if earlier is not None:
        for key in ("workloads", "runs"):  # offline: workloads; served: runs
            if key in new:
                new[key] = {**earlier.get(key, {}), **new[key]}
    entry[phase] = new


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args()
    if args.from_results is not None:
        finish(json.loads(args.from_results.read_text()), MODEL_DIR, args.from_results.parent, args.publish)
        return 0
    names = [s.strip() for s in args.only.split(",") if s.strip()]
    wl_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.out_dir or REPO / "bench" / "results" / f"engine-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        args.threads,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.kv_cache_gib,
        args.hf_batch_sizes,
        args.hf_w2_batch_sizes,
        args.hf_dtype,
        args.temperature,
        tuple(shlex.split(args.corral_flags)),
    )
    results: dict[str, Any] = {
        "command": " ".join(["bench/engine/compare.py", *sys.argv[1:]]),
        "started_utc": stamp,
        "quick": args.quick,
        "settings": dataclasses.asdict(settings),
        "machine": machine_info(),
        "systems": {},
    }
    model = ensure_model()
    systems: dict[str, System | None] = {}
    for name in names:
        try:
            log.info("preparing %s (venv install on first use)", name)
            systems[name] = build(name, settings)
            entry = {"label": systems[name].label, "python": str(systems[name].python)}  # type: ignore[union-attr]
            results["systems"][name] = {**entry, "env": systems[name].env}  # type: ignore[union-attr]
        except (envs.EnvError, subprocess.SubprocessError, OSError, ValueError) as e:
            log.error("%s unavailable: %s", name, e)
            systems[name] = None
            results["systems"][name] = {"label": name, "error": str(e)}
    wl = write_workloads(wl_names, model, out_dir, args.quick, rates)
    results["workloads"] = wl["meta"]
    results["bandwidth"] = measure_bandwidth(out_dir, settings.threads)
    log.info(
        "memory bandwidth (torch copy, %d threads): %.1f GB/s",
        settings.threads,
        results["bandwidth"]["copy_gb_s_best"],
    )

    t0 = time.monotonic()

    def run_phase(
        phase: str,
        name: str,
        system: System | None,
        offline_wl: dict[str, Path],
        served_runs: list[runner.ServedRun],
    ) -> None:
        """One system's offline phase on `offline_wl` or served phase on `served_runs`."""
        if phase == "offline":
            if args.no_offline or not offline_wl:
                return
            fn = lambda s: runner.run_offline(s, model, offline_wl, out_dir, settings, args.offline_timeout)  # noqa: E731
        else:
            if args.no_served or not served_runs or system is None or not system.is_served:
                return
            fn = lambda s: runner.run_served(s, model, served_runs, out_dir, settings, args.served_timeout)  # noqa: E731
        _phase(results, name, system, phase, fn, merge=args.paired)
        _save(results, out_dir)

    for round_index in range(args.rounds):
        if args.rounds > 1:
            log.info("round %d of %d", round_index + 1, args.rounds)
        order = ("served", "offline") if round_index % 2 else ("offline", "served")
        if args.paired:  # per workload, each system's two phases back to back
            for entry in results["systems"].values():  # a failed run must not keep last round's figure
                entry.pop("offline", None)
                entry.pop("served", None)
            for w in wl_names:
                runs = [r for r in wl["served"] if r.key.split("@")[0] == w]
                for name, system in systems.items():
                    for phase in order:
                        run_phase(phase, name, system, {w: wl["offline"][w]}, runs)
        else:  # every system's offline phase, then every system's served phase (or the reverse)
            for phase in order:
                for name, system in systems.items():
                    run_phase(phase, name, system, wl["offline"], wl["served"])
        if args.rounds > 1:  # `systems` keeps the last round; each round's figures stay here
            results.setdefault("rounds", []).append(copy.deepcopy(results["systems"]))
            _save(results, out_dir)
    results["elapsed_s"] = time.monotonic() - t0
    results["machine"]["loadavg_end"] = os.getloadavg()
    finish(results, model, out_dir, args.publish)
    return 0


def finish(results: dict[str, Any], model: Path, out_dir: Path, publish: bool) -> None:
    """MBU, ratios, targets; results.json, table.md and PNGs in out_dir (and docs/ with publish)."""
    add_mbu(results, model)
    results["ratios"] = report.ratios(results)
    results["targets"] = report.target_checks(results)
    if results.get("rounds"):
        results["ratio_rounds"] = report.ratio_rounds(results)
    results["served_over_offline"] = report.served_over_offline(results)
    _save(results, out_dir)
    pngs = plots.plot_all(results, out_dir)
    text = "\n\n".join(
        t
        for t in (
            report.markdown_table(results),
            report.markdown_ratio_rounds(results),
            report.markdown_targets(results),
            report.markdown_served_over_offline(results),
            report.markdown_served_cpu(results),
            report.failures(results),
        )
        if t
    )
    (out_dir / "table.md").write_text(text + "\n")
    sys.stdout.write("\n" + text + "\n\n")
    log.info("results in %s", out_dir)
    if publish:
        _publish(out_dir, pngs)


def _save(results: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))


def _publish(out_dir: Path, pngs: list[Path]) -> None:
    shutil.copy(out_dir / "results.json", REPO / "docs" / "engine-speed.json")
    (REPO / "docs" / "plots").mkdir(exist_ok=True)
    for png in pngs:
        shutil.copy(png, REPO / "docs" / "plots" / png.name)
    log.info("published docs/engine-speed.json and %d plots to docs/plots/", len(pngs))


if __name__ == "__main__":
    raise SystemExit(main())
