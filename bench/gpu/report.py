"""Issue 22's targets (acceptance 4) checked against a GPU run's figures, and its Markdown table."""

from __future__ import annotations

from typing import Any

TARGET_PRESET = "llama3-8b"


def _target(
    name: str, value: float | bool | None, goal: str, met: bool | None, note: str = ""
) -> dict[str, Any]:
    return {"target": name, "value": value, "goal": goal, "met": met, "note": note}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target; `met` is None where the run has no figure for it. A smoke run's rows are
    computed the same way but say so: they measure the harness, not a GPU."""
    phases = results.get("phases", {})
    smoke = "smoke run on CPU: not a measurement of the target" if results.get("mode") == "smoke" else ""
    rows = []
    eq = phases.get("equality", {})
    passed = eq.get("passed")
    on_cuda = eq.get("device", "").startswith("cuda")
    rows.append(
        _target(
            "greedy equality, all architectures",
            passed,
            "equal on CUDA",
            None if passed is None else bool(passed) and on_cuda,
            smoke,
        )
    )
    b1 = phases.get("batch1", {})
    mbu = b1.get("variants", {}).get("default", {}).get("mbu_ratio")
    note = smoke or ("" if b1.get("preset") in (None, TARGET_PRESET) else f"preset {b1.get('preset')}")
    rows.append(
        _target(
            "batch-1 model-bandwidth utilisation",
            mbu,
            ">= 0.70 (llama3-8b)",
            None if mbu is None else mbu >= 0.70,
            note,
        )
    )
    ratio = phases.get("throughput", {}).get("ratios", {}).get("W2_corral_over_hf-static")
    rows.append(
        _target(
            "W2 output throughput vs transformers static",
            ratio,
            ">= 5x",
            None if ratio is None else ratio >= 5.0,
            smoke,
        )
    )
    batches = phases.get("overhead", {}).get("batches", {})
    outside = batches.get("64", {}).get("outside_kernels_ratio")
    rows.append(
        _target(
            "time outside kernels at batch 64",
            outside,
            "< 0.10",
            None if outside is None else outside < 0.10,
            smoke or _no64(batches),
        )
    )
    return rows


def _no64(batches: dict[str, Any]) -> str:
    return "" if "64" in batches or not batches else f"batches measured: {', '.join(batches)}"


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown(results: dict[str, Any]) -> str:
    phases = results.get("phases", {})
    env = phases.get("env", {})
    lines = [
        f"GPU run: {env.get('gpu') or env.get('device', '?')}, mode {results.get('mode')}, "
        f"commit {results.get('commit') or '?'}, torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}, triton {env.get('triton', '?')}",
        "",
        "| target | value | goal | met | note |",
        "|---|---|---|---|---|",
    ]
    for row in results.get("targets") or targets(results):
        met = {True: "yes", False: "no", None: "-"}[row["met"]]
        lines.append(f"| {row['target']} | {_fmt(row['value'])} | {row['goal']} | {met} | {row['note']} |")
    lines += ["", "| phase | figures |", "|---|---|"]
    for name, figures in phases.items():
        lines.append(f"| {name} | {_summary(name, figures)} |")
    return "\n".join(lines) + "\n"


def _summary(name: str, f: dict[str, Any]) -> str:
    if "error" in f:
        return f"failed: {f['error']}"
    if name == "bandwidth":
        return f"read {f['read_gb_s_median']:.0f} GB/s, copy {f['copy_gb_s_median']:.0f} GB/s (medians)"
    if name == "equality":
        return (
            "passed"
            if f["passed"]
            else "FAILED: "
            + ", ".join(
                f"{a} {v['num_equal']}/{e['num_prompts']}"
                for a, e in f["archs"].items()
                for v in e["variants"]
            )
        )
    if name == "batch1":
        return "; ".join(
            f"{n}: {v['tpot_ms']:.3f} ms/token, {v['achieved_gb_s']:.0f} GB/s, MBU {_fmt(v.get('mbu_ratio'))}"
            for n, v in f["variants"].items()
        )
    if name == "overhead":
        return "; ".join(
            f"batch {b}: step {v['step_ms']:.2f} ms, outside {_fmt(v['outside_kernels_ratio'])}"
            for b, v in f["batches"].items()
        )
    if name == "throughput":
        parts = []
        for system, v in f["systems"].items():
            if v.get("status") != "ok":
                parts.append(f"{system}: {v.get('status')}")
                continue
            tps = ", ".join(f"{w} {x['output_throughput']:.0f}" for w, x in v["workloads"].items())
            parts.append(f"{system}: {tps} tok/s")
        parts += [f"{k} {v:.2f}x" for k, v in f.get("ratios", {}).items()]
        return "; ".join(parts)
    if name == "served":
        return "; ".join(
            f"{rate} req/s: TTFT p50 {v['ttft_ms']['p50']:.1f} / p99 {v['ttft_ms']['p99']:.1f} ms, "
            f"TPOT p50 {v['tpot_ms']['p50']:.2f} / p99 {v['tpot_ms']['p99']:.2f} ms, "
            f"{v['output_throughput']:.0f} tok/s, mixed steps {v['steps']['mixed']['count']} x "
            f"{v['steps']['mixed']['mean_ms']:.2f} ms, decode steps {v['steps']['decode']['count']} x "
            f"{v['steps']['decode']['mean_ms']:.2f} ms"
            + (
                f", double {v['steps']['double']['count']} x {v['steps']['double']['mean_ms']:.2f} ms"
                if "double" in v["steps"]
                else ""
            )
            + (
                f", {v['kernel_variants_compiled']} kernel variants compiled"
                if "kernel_variants_compiled" in v
                else ""
            )
            for rate, v in f["rates"].items()
        )
    if name == "lora":
        return _lora_summary(f)
    if name == "quant":
        return _quant_summary(f)
    if name == "int4":
        return _int4_summary(f)
    return ", ".join(f"{k} {_fmt(v)}" for k, v in f.items() if not isinstance(v, dict | list))


def _lora_summary(f: dict[str, Any]) -> str:
    eq = f["equality"]
    refs = ", ".join(
        f"{name} {r['num_equal']}/{eq['num_prompts']}" if "error" not in r else f"{name} -"
        for name, r in eq["references"].items()
    )
    speed = f["speed"]
    steps = "; ".join(
        f"batch {b}: step "
        + ", ".join(f"{arm} {v['batches'][b]['step_ms']:.2f} ms" for arm, v in speed["arms"].items())
        + f" (lora-base {r['lora_base_over_no_lora']:.2f}x, lora-4 {r['lora_4_over_no_lora']:.2f}x)"
        for b, r in speed["ratios"].items()
    )
    return f"mixed batch (2 adapters + base) {'equal' if eq['passed'] else 'NOT equal'}: {refs}; {steps}"


def _int4_summary(f: dict[str, Any]) -> str:
    agree, speed = f["agreement"], f["speed"]
    parts = [
        f"agreement failed: {agree['error']}"
        if "error" in agree
        else f"awq int4 kernel vs dequantized ({agree['preset']}, bf16): {agree['num_equal']}/"
        f"{agree['num_prompts']} prompts equal, share {agree['share']:.2f}"
    ]
    if "error" in speed:
        parts.append(f"speed failed: {speed['error']}")
    else:
        parts += [
            f"batch {b}: bf16 {speed['arms']['bf16']['batches'][b]['step_ms']:.2f} ms, awq "
            f"{speed['arms']['awq']['batches'][b]['step_ms']:.2f} ms ({r:.2f}x)"
            for b, r in speed["awq_over_bf16_step"].items()
        ]
    return "; ".join(parts)


def _quant_summary(f: dict[str, Any]) -> str:
    w = f["weights_gib"]
    weights = f"weights ({f['preset']}, from its config) bf16 {w['bf16']:.3g} GiB, fp8 {w['fp8']:.3g} GiB"
    if "skipped" in f:
        return f"skipped: {f['skipped']}; {weights}"
    parts = []
    agree = f["agreement"]
    if "error" in agree:
        parts.append(f"agreement failed: {agree['error']}")
    else:
        fp8, bf16 = agree["fp8"], agree["bf16"]
        parts.append(
            f"fp8 vs dequantized float32 reference ({agree['preset']}): agreement {fp8['share']:.2f}, "
            f"{fp8['num_equal']}/{agree['num_prompts']} prompts equal over {agree['new_tokens']} tokens "
            f"(bf16 vs float32: {bf16['share']:.2f}, {bf16['num_equal']}/{agree['num_prompts']})"
        )
    speed = f["speed"]
    if "error" in speed:
        parts.append(f"speed failed: {speed['error']}")
    else:
        arms = speed["arms"]
        for b, ratio in speed["fp8_over_bf16_step"].items():
            steps = ", ".join(
                f"{arm} {a['batches'][b]['step_ms']:.2f} ms (MBU {_fmt(a['batches'][b].get('mbu_ratio'))})"
                for arm, a in arms.items()
            )
            parts.append(f"batch {b}: step {steps}, fp8/bf16 {ratio:.2f}x")
        blocks = ", ".join(f"{arm} {a['engine'].get('num_kv_blocks')}" for arm, a in arms.items())
        parts.append(f"KV blocks {blocks}")
        if "fp8_over_bf16_w2" in speed:
            w2 = ", ".join(f"{arm} {a['w2']['output_throughput']:.0f}" for arm, a in arms.items())
            parts.append(f"W2 {w2} tok/s ({speed['fp8_over_bf16_w2']:.2f}x)")
    return "; ".join([*parts, weights])
