"""Weight quantization's decisions (model/quant.py: what a config.json and --quantization ask for,
how each device runs it, with fake GPU capabilities) and its tensor work (model/quant_ops.py)."""

from __future__ import annotations

import pytest
import torch
from corral_engine.demo_fp8 import fp8_quantization_config, quantize_blocks
from corral_engine.errors import ModelLoadError
from corral_engine.model.quant import QuantConfig, QuantPlan, model_quant_config, plan_quant, quant_config
from corral_engine.model.quant_ops import FP8, dequantize, fp8_linear, int8_linear, quantize_rows

HF_FP8 = fp8_quantization_config()
# llm-compressor's FP8_DYNAMIC scheme as config.json holds it.
COMPRESSED_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "type": "float",
                "num_bits": 8,
                "strategy": "channel",
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}


@pytest.mark.parametrize(
    ("raw", "method"),
    [
        ({"quant_method": "gguf"}, "'gguf'"),
        ({"quant_method": "exl2", "bits": 4}, "'exl2'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"load_in_8bit": True}, "None"),
    ],
)
def test_methods_corral_does_not_serve_are_refused_saying_what_it_serves(raw: dict, method: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        quant_config(None, raw)
    message = str(info.value)
    assert f"quantization method {method} in config.json is not supported" in message
    assert "fp8 checkpoints" in message and "--quantization fp8|int8" in message
    assert "awq gemm, gptq 4/8-bit, compressed-tensors pack-quantized" in message


def test_a_quantization_flag_on_a_checkpoint_quantized_otherwise_is_a_contradiction() -> None:
    with pytest.raises(ModelLoadError, match=r"--quantization int8 contradicts config.json.*'gptq'"):
        quant_config("int8", {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ModelLoadError, match=r"--quantization int8 contradicts config.json.*'exl2'"):
        quant_config("int8", {"quant_method": "exl2"})


def test_hf_fp8_and_compressed_tensors_fp8_are_read() -> None:
    assert quant_config(None, None) is None
    assert quant_config("int8", None) == QuantConfig(method="int8")
    hf = quant_config(None, HF_FP8)
    assert hf == QuantConfig(checkpoint="fp8", block_size=(128, 128), skip=("lm_head",))
    assert quant_config("fp8", {"quant_method": "fp8"}) == QuantConfig(method="fp8", checkpoint="fp8")
    ct = quant_config("int8", COMPRESSED_FP8)
    assert ct is not None and (ct.checkpoint, ct.scale_suffix, ct.method) == (
        "compressed-tensors",
        "weight_scale",
        "int8",
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**HF_FP8, "activation_scheme": "static"}, "static activation scales"),
        ({**HF_FP8, "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
        ({**HF_FP8, "scale_fmt": "ue8m0"}, "only float32 scales"),
        ({**HF_FP8, "modules_to_convert": ["embed_tokens"]}, "fp8 embeddings"),
        (
            {**COMPRESSED_FP8, "format": "pack-quantized"},
            "float 8-bit weights \\(only int 4-bit and 8-bit\\)",
        ),
        ({**COMPRESSED_FP8, "format": "marlin-24"}, "format 'marlin-24' is not supported"),
        ({**COMPRESSED_FP8, "kv_cache_scheme": {"num_bits": 8}}, "quantized KV cache"),
    ],
)
def test_fp8_variants_corral_cannot_load_are_refused(raw: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        quant_config(None, raw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"input_activations": {"type": "float", "num_bits": 8, "dynamic": False}},
            "static activation scales",
        ),
        ({"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}, "int 8-bit weights"),
        ({"weights": {"type": "float", "num_bits": 8, "strategy": "block"}}, "strategy 'block'"),
    ],
)
def test_compressed_tensors_schemes_other_than_dynamic_fp8_are_refused(change: dict, message: str) -> None:
    group = {**COMPRESSED_FP8["config_groups"]["group_0"], **change}  # type: ignore[index]
    with pytest.raises(ModelLoadError, match=message):
        quant_config(None, {**COMPRESSED_FP8, "config_groups": {"g": group}})


def test_quantized_mixture_of_experts_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="not supported for mixture-of-experts models"):
        model_quant_config("int8", None, is_moe=True)
    assert model_quant_config(None, None, is_moe=True) is None


def test_modules_to_not_convert_follow_transformers_rule() -> None:
    config = QuantConfig(checkpoint="fp8", skip=("lm_head", "model.layers.1", "re:.*mlp\\.down_proj$"))
    assert config.is_skipped("lm_head")
    assert config.is_skipped("model.layers.1.self_attn.q_proj")
    assert not config.is_skipped("model.layers.11.self_attn.q_proj")  # a prefix only to a dot
    assert config.is_skipped("model.layers.0.mlp.down_proj")
    assert not config.is_skipped("model.layers.0.mlp.up_proj")


CPU = "cpu"


@pytest.mark.parametrize(
    ("config", "device", "capability", "dtype", "int8_kernel", "weights", "warns"),
    [
        (None, CPU, None, "bfloat16", True, None, False),
        (QuantConfig(method="int8"), CPU, None, "float32", True, "int8", False),
        (QuantConfig(method="fp8"), CPU, None, "bfloat16", True, "int8", False),  # no fp8 matmul on CPU
        (QuantConfig(checkpoint="fp8"), CPU, None, "float32", True, None, False),  # dequantized, exact
        (QuantConfig(method="int8", checkpoint="fp8"), CPU, None, "float32", True, "int8", False),
        (QuantConfig(checkpoint="fp8"), "cuda", (9, 0), "bfloat16", True, "fp8", False),
        (QuantConfig(method="fp8"), "cuda", (8, 9), "bfloat16", True, "fp8", False),
        (QuantConfig(method="fp8"), "cuda", (8, 6), "bfloat16", True, None, True),  # Ampere: dequantized
        (QuantConfig(checkpoint="fp8"), "cuda", (9, 0), "float16", True, None, True),  # bf16 output only
        (QuantConfig(method="int8"), "cuda", (9, 0), "bfloat16", True, "int8", False),
        (QuantConfig(method="int8"), "cuda", (9, 0), "bfloat16", False, None, True),
    ],
)
def test_what_each_device_runs(
    config: QuantConfig | None,
    device: str,
    capability: tuple[int, int] | None,
    dtype: str,
    int8_kernel: bool,
    weights: str | None,
    warns: bool,
) -> None:
    plan = plan_quant(config, device, capability, dtype, int8_kernel)
    assert (plan.weights, plan.is_warning) == (weights, warns)
    assert isinstance(plan, QuantPlan) and (plan.note != "") == (config is not None)


def test_rows_quantize_each_on_its_own_scale() -> None:
    w = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 10.0, 0.0, 5.0, 100.0])[:, None]
    for dtype, tolerance in ((torch.int8, 0.5 / 127), (FP8, 1 / 16)):
        q, scale = quantize_rows(w, dtype)
        assert q.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (6,)
        back = q.float() * scale[:, None]
        amax = w.abs().amax(dim=1, keepdim=True)
        assert torch.all((back - w).abs() <= tolerance * amax + 1e-12)
        assert torch.equal(back[3], torch.zeros(40))  # an all-zero row stays zero
        # A slice of rows quantizes to the same values: what lets shards load independently.
        q_part, scale_part = quantize_rows(w[2:5], dtype)
        assert torch.equal(q_part.float(), q[2:5].float()) and torch.equal(scale_part, scale[2:5])


def test_ragged_block_scales_dequantize_per_block_and_per_slice() -> None:
    w = torch.randn(200, 300)
    q, scale_inv = quantize_blocks(w, (128, 128))
    assert q.dtype == FP8 and scale_inv.shape == (2, 3)  # ceil(200/128), ceil(300/128)
    whole = dequantize(q, scale_inv, (128, 128), None, "w")
    for r in range(2):
        for c in range(3):
            block = (slice(r * 128, (r + 1) * 128), slice(c * 128, (c + 1) * 128))
            assert torch.equal(whole[block], q[block].float() * scale_inv[r, c])
    assert (whole - w).abs().max() <= w.abs().max() / 16
    # A rank's rows (column-parallel) or columns (row-parallel) read the blocks they fall in.
    assert torch.equal(dequantize(q[100:150], scale_inv, (128, 128), (0, 100, 50), "w"), whole[100:150])
    assert torch.equal(dequantize(q[:, 150:300], scale_inv, (128, 128), (1, 150, 150), "w"), whole[:, 150:])
    with pytest.raises(ModelLoadError, match="does not cover the weight"):
        dequantize(q, scale_inv[:1], (128, 128), None, "w")


def test_block_dequantization_equals_transformers_where_blocks_divide() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(256, 384)
    q, scale_inv = quantize_blocks(w, (128, 128))
    theirs = Fp8Dequantize(None)._dequantize_one(q, scale_inv, output_dtype=torch.float32)
    assert torch.equal(dequantize(q, scale_inv, (128, 128), None, "w"), theirs)


def test_channel_and_tensor_scales_dequantize() -> None:
    q = (torch.randn(8, 16) * 50).to(FP8)
    rows = torch.rand(8, 1) + 0.5
    assert torch.equal(dequantize(q, rows, None, None, "w"), q.float() * rows)
    assert torch.equal(dequantize(q[4:], rows, None, (0, 4, 4), "w"), q[4:].float() * rows[4:])
    assert torch.equal(dequantize(q, torch.tensor([0.25]), None, None, "w"), q.float() * 0.25)


def test_the_quantized_matmuls_multiply_the_dequantized_weight() -> None:
    x = torch.randn(5, 64)
    w = torch.randn(32, 64)
    bias = torch.randn(32)
    q, scale = quantize_rows(w, torch.int8)
    want = x @ (q.float() * scale[:, None]).T + bias
    assert torch.allclose(int8_linear(x, q, scale, bias), want, atol=1e-4)
    # fp8 (CUDA's path; PyTorch's CPU _scaled_mm runs it here): activations quantized per token
    q8, scale8 = quantize_rows(w, FP8)
    got = fp8_linear(x.bfloat16(), q8, scale8.view(1, -1), None)
    ref = x @ (q8.float() * scale8[:, None]).T
    assert got.dtype == torch.bfloat16 and torch.allclose(
        got.float(), ref, rtol=0.1, atol=0.1 * ref.abs().max().item()
    )
    assert fp8_linear(x[:0].bfloat16(), q8, scale8.view(1, -1), None).shape == (0, 32)
