"""bench/gpu's acceptance script end to end in its CPU smoke mode (the GPU run is the same code with
the issue's sizes), and the pure parts it reports with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from corral_engine.demo_model import ARCHITECTURES

from bench.gpu import measure, report
from bench.gpu.acceptance import PHASES, RESULT_FILE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu-smoke")
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu.acceptance",
        "--smoke",
        "--out",
        str(out / "run"),
        "--models-dir",
        str(out / "models"),
        "--commit",
        "test",
    ]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "run" / RESULT_FILE).read_text()), out / "run"


def test_every_phase_has_its_figures(smoke: tuple[dict, Path]) -> None:
    results, _ = smoke
    phases = results["phases"]
    assert list(phases) == list(PHASES)
    assert not [name for name, figures in phases.items() if "error" in figures]
    assert phases["env"]["torch"] and phases["env"]["device"] == "cpu"
    assert phases["bandwidth"]["read_gb_s_median"] > 0 and phases["bandwidth"]["copy_gb_s_median"] > 0
    default = phases["batch1"]["variants"]["default"]
    assert default["tpot_ms"] > 0 and default["mbu_ratio"] > 0 and default["num_tokens"] == 16
    for figures in phases["overhead"]["batches"].values():
        assert figures["step_ms"] > 0 and figures["num_device_events"] > 0
        assert 0 <= figures["outside_kernels_ratio"] <= 1
    throughput = phases["throughput"]
    assert throughput["systems"]["corral"]["status"] == "ok"
    assert throughput["systems"]["hf-static"]["status"] == "ok"
    assert throughput["systems"]["hf-cb"]["status"] in ("ok", "absent")
    assert throughput["ratios"]["W2_corral_over_hf-static"] > 0
    served = phases["served"]["rates"]["50"]
    assert served["num_requests"] == 6 and served["output_tokens"] > 0
    assert 0 < served["ttft_ms"]["p50"] <= served["ttft_ms"]["p99"] < served["e2e_ms"]["p99"] + 1e-6
    assert served["steps"]["mixed"]["count"] > 0 and served["steps"]["decode"]["count"] > 0
    assert {row["target"] for row in results["targets"]} >= {"time outside kernels at batch 64"}
    assert results["commit"] == "test" and results["mode"] == "smoke"


def test_equality_passes_for_every_architecture(smoke: tuple[dict, Path]) -> None:
    equality = smoke[0]["phases"]["equality"]
    assert equality["passed"]
    assert sorted(equality["archs"]) == sorted(ARCHITECTURES)  # every demo architecture, MoE included
    for arch in equality["archs"].values():
        assert all(v["num_equal"] == arch["num_prompts"] for v in arch["variants"])


def test_lora_phase_equality_and_step_times(smoke: tuple[dict, Path]) -> None:
    lora = smoke[0]["phases"]["lora"]
    equality = lora["equality"]
    assert equality["passed"] and equality["dtype"] == "float32"
    assert equality["adapters"] == ["all7", "qvd", "base"]  # two adapters and the base model, mixed
    for name in ("engine-cpu", "peft"):  # peft is a dev dependency here, and in the GPU image
        assert equality["references"][name]["num_equal"] == equality["num_prompts"]
    speed = lora["speed"]
    assert list(speed["arms"]) == ["no-lora", "lora-base", "lora-4"]
    for arm in speed["arms"].values():
        assert all(v["step_ms"] > 0 and v["rows_last_step"] == int(b) for b, v in arm["batches"].items())
    assert set(speed["ratios"]) == {"1", "8"}
    assert all(
        r["lora_base_over_no_lora"] > 0 and r["lora_4_over_no_lora"] > 0 for r in speed["ratios"].values()
    )
    assert (
        "| lora | mixed batch (2 adapters + base) equal: engine-cpu 3/3, peft 3/3;"
        in (smoke[1] / "table.md").read_text()
    )


def test_quant_phase_skips_on_cpu_with_a_note_and_a_table_row(smoke: tuple[dict, Path]) -> None:
    figures = smoke[0]["phases"]["quant"]
    assert figures["skipped"].startswith("no CUDA device") and "agreement" not in figures
    assert figures["weights_gib"]["fp8"] < figures["weights_gib"]["bf16"]
    assert "| quant | skipped: no CUDA device" in (smoke[1] / "table.md").read_text()


def test_plots_table_and_merge(smoke: tuple[dict, Path], tmp_path: Path) -> None:
    results, out = smoke
    for name in ("equality", "batch1", "throughput", "overhead"):
        assert (out / f"gpu-{name}.png").stat().st_size > 10_000
    assert "| W2 output throughput vs transformers static |" in (out / "table.md").read_text()
    # A run split across two calls: the second's phases join the first's; a second throughput
    # phase (another system) joins the first one's systems.
    corral = results["phases"]["throughput"]["systems"]["corral"]["workloads"]["W2"]["output_throughput"]
    other = {"status": "ok", "workloads": {"W2": {"output_throughput": corral / 4}}}
    second = {
        **results,
        "runs": [{"phases": ["bandwidth", "throughput"]}],
        "phases": {
            "bandwidth": {"read_gb_s_median": 1.0, "copy_gb_s_median": 2.0},
            "throughput": {**results["phases"]["throughput"], "systems": {"hf-cb": other}, "ratios": {}},
        },
    }
    (tmp_path / "b.json").write_text(json.dumps(second))
    merged_dir = tmp_path / "merged"
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu.acceptance",
        "--merge",
        str(out / RESULT_FILE),
        str(tmp_path / "b.json"),
        "--out",
        str(merged_dir),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=120)
    merged = json.loads((merged_dir / RESULT_FILE).read_text())
    assert merged["phases"]["bandwidth"]["read_gb_s_median"] == 1.0
    assert merged["phases"]["equality"]["passed"] and len(merged["runs"]) == 2
    throughput = merged["phases"]["throughput"]
    assert set(throughput["systems"]) >= {"corral", "hf-static", "hf-cb"}
    assert throughput["ratios"]["W2_corral_over_hf-cb"] == pytest.approx(4.0)
    assert "W2_corral_over_hf-static" in throughput["ratios"]


def test_bytes_read_per_token_of_the_8b_shape() -> None:
    from corral_engine.demo_model import build_config_dict

    figures = measure.decode_bytes_per_token(build_config_dict("llama3-8b"), 2, context_len=1000)
    # 8.03e9 parameters, less the input embedding but one row of it, in bf16
    assert figures["weight_bytes"] == 2 * (8_030_261_248 - 128_256 * 4096 + 4096)
    assert figures["kv_bytes_per_context_token"] == 2 * 32 * 8 * 128 * 2
    assert figures["bytes_per_token"] == figures["weight_bytes"] + 1000 * 131_072


def test_union_counts_overlaps_once() -> None:
    assert measure.union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert measure.union_us([]) == 0


def test_targets_are_judged_only_where_there_are_figures() -> None:
    results = {
        "mode": "gpu",
        "phases": {
            "equality": {"passed": True, "device": "cuda"},
            "batch1": {"preset": "llama3-8b", "variants": {"default": {"mbu_ratio": 0.72}}},
            "overhead": {"batches": {"1": {"outside_kernels_ratio": 0.3}}},
        },
    }
    met = {row["target"]: row["met"] for row in report.targets(results)}
    assert met == {
        "greedy equality, all architectures": True,
        "batch-1 model-bandwidth utilisation": True,
        "W2 output throughput vs transformers static": None,
        "time outside kernels at batch 64": None,
    }


def test_served_phase_times_what_the_engine_hands_back() -> None:
    """run_at_rate against a scripted engine: one step per call, each request's tokens arriving a
    step at a time, prompt steps classed as mixed; latencies from the handed-back outputs."""
    from types import SimpleNamespace

    from bench.gpu.served import run_at_rate

    class Engine:
        def __init__(self) -> None:
            self.live: dict[str, list[int]] = {}  # request id -> [tokens so far, tokens asked]
            self.last_schedule: list[SimpleNamespace] = []
            self.step_in_flight = False

        def add_request(self, request_id: str, prompt: list[int], params: object) -> None:
            self.live[request_id] = [0, params.max_tokens]  # type: ignore[attr-defined]

        def has_unfinished_requests(self) -> bool:
            return bool(self.live)

        def step(self) -> list[SimpleNamespace]:
            self.last_schedule = [
                SimpleNamespace(num_new_tokens=5 if done == 0 else 1, num_spec=0)
                for done, _ in self.live.values()
            ]
            outputs = []
            for rid, state in list(self.live.items()):
                state[0] += 1
                outputs.append(
                    SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=[0] * state[0])])
                )
                if state[0] == state[1]:
                    del self.live[rid]
            return outputs

    figures = run_at_rate(Engine(), [([1, 2, 3], 4), ([4, 5], 3), ([6], 1)], rate=1000.0, seed=1)
    assert figures["output_tokens"] == 8
    assert figures["steps"]["mixed"]["count"] >= 1 and figures["steps"]["decode"]["count"] >= 1
    assert figures["ttft_ms"]["p50"] >= 0 and figures["tpot_ms"]["p50"] >= 0
    assert abs(sum(k["share_of_step_time"] for k in figures["steps"].values()) - 1) < 1e-9
