"""bench/gpu's quant phase on CPU, without the engine's quantization: when it skips and why, the
byte arithmetic its MBU and weight figures rest on, the fp8 round trip of its reference, and the
whole phase's plumbing with the fp8 arm standing in as an unquantized engine."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from corral_engine.demo_model import build_config_dict, count_parameters

from bench.gpu import quant, report
from bench.gpu.context import SMOKE, Run

GIB = 1 << 30
# Llama-3-8B: 32 layers of q, k, v, o (4096 x 4096, 2 x 4096 x 1024, 4096 x 4096) and the MLP's
# gate, up, down (3 x 4096 x 14336).
LLAMA3_8B_PROJECTIONS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)


@pytest.mark.parametrize(
    ("device", "capability", "fields", "said"),
    [
        ("cpu", None, {"quantization"}, "no CUDA device"),
        ("cuda", (8, 0), {"quantization"}, "compute capability 8.0 < 8.9"),
        ("cuda", (9, 0), {"dtype"}, "no quantization option"),
    ],
)
def test_the_phase_says_why_it_cannot_measure_fp8(
    device: str, capability: tuple[int, int] | None, fields: set[str], said: str
) -> None:
    reason = quant.skip_reason(device, capability, fields)
    assert reason is not None and said in reason


def test_an_fp8_gpu_with_the_engine_option_runs() -> None:
    assert quant.skip_reason("cuda", (8, 9), {"quantization"}) is None
    assert quant.skip_reason("cuda", (9, 0), {"quantization"}) is None


def test_weight_and_decode_bytes_of_the_8b_shape() -> None:
    config = build_config_dict("llama3-8b")
    assert quant.projection_params(config) == LLAMA3_8B_PROJECTIONS
    total = count_parameters(config)
    gib = quant.weight_gib(config)
    assert gib["bf16"] == 2 * total / GIB
    assert gib["fp8"] == (2 * total - LLAMA3_8B_PROJECTIONS) / GIB  # ~9.0 GiB of ~15.0
    assert 0.86 < gib["projection_share"] < 0.88
    bf16 = quant.decode_bytes(config, False, 64, 1000)
    assert bf16 - quant.decode_bytes(config, True, 64, 1000) == LLAMA3_8B_PROJECTIONS
    kv = 2 * 32 * 8 * 128 * 2  # K and V in bf16, a token
    assert bf16 - quant.decode_bytes(config, False, 1, 1000) == 63 * 1000 * kv


def test_the_fp8_round_trip_keeps_each_rows_largest_weight_and_rounds_the_rest() -> None:
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))  # [out, in]
    back = quant.fp8_round_trip(weight)
    assert back.dtype == weight.dtype and back.shape == weight.shape
    # The largest lands on 448, which e4m3 holds exactly: back but for the float32 division's rounding.
    torch.testing.assert_close(back.abs().amax(dim=1), weight.abs().amax(dim=1), rtol=1e-6, atol=0)
    assert not torch.equal(back, weight)
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 1/16 of itself.
    normal = weight.abs() > weight.abs().amax(dim=1, keepdim=True) / 448 * 2**-6
    assert ((back - weight).abs() <= weight.abs() / 16 + 1e-12)[normal].all()


def test_agreement_counts_tokens_before_the_first_difference() -> None:
    figures = quant.agreement([[1, 2, 3, 4], [1, 2, 3, 4]], [[1, 2, 3, 4], [1, 9, 3, 4]], 4)
    assert figures == {"num_equal": 1, "first_divergence": [None, 1], "share": 5 / 8}


def test_the_whole_phase_on_cpu_with_an_unquantized_stand_in(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every part's plumbing (engines, step timing, W2, the reference, the table row), the fp8 arm
    being the plain engine: the engine's quantization need not exist for this to run."""
    shutil.copytree(tiny_model_dir, tmp_path / "tiny-llama-seed0")
    (tmp_path / "tiny-llama-seed0.complete").write_text("{}")  # Run.model_dir's marker: reuse it
    monkeypatch.setattr(quant, "skip_reason", lambda *_: None)
    monkeypatch.setattr(quant, "ARMS", {"bf16": {}, "fp8": {}})
    run = Run(SMOKE, tmp_path)
    figures = quant.quant(run, {"bandwidth": {"read_gb_s_median": 10.0}})
    run.release()
    agreement, speed = figures["agreement"], figures["speed"]
    assert "error" not in agreement and "error" not in speed, json.dumps(figures)[-3000:]
    assert agreement["num_prompts"] == 2 and agreement["new_tokens"] == 8
    # The stand-in fp8 arm is the plain engine, so only the unrounded reference must agree in full.
    assert agreement["bf16"]["share"] == 1.0 and agreement["bf16"]["num_equal"] == 2
    assert 0.0 <= agreement["fp8"]["share"] <= 1.0
    assert set(speed["arms"]) == {"bf16", "fp8"} and set(speed["fp8_over_bf16_step"]) == {"1", "8"}
    for arm in speed["arms"].values():
        assert arm["weights_gib_allocated"] > 0 and arm["w2"]["output_throughput"] > 0
        assert all(b["step_ms"] > 0 and b["mbu_ratio"] > 0 for b in arm["batches"].values())
    row = report._summary("quant", figures)
    assert row.startswith("fp8 vs dequantized float32 reference (tiny): agreement ")
    assert "batch 8: step bf16 " in row and "W2 bf16 " in row and "weights (tiny, from its config)" in row
