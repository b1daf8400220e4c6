"""Integer weight-only checkpoints' decisions and tensor work: the three configs read (and what is
refused), how each device runs them (fake GPUs), hand-written packed words decoded by each format's
documented rule, and the int4 Linear's kernel path against F.linear on its dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from corral_engine.demo_int4 import quantization_config
from corral_engine.errors import ModelLoadError
from corral_engine.model.int4_ops import (
    int4_fits,
    pack_nibbles,
    unpack_awq,
    unpack_compressed,
    unpack_gptq,
)
from corral_engine.model.llama import Linear
from corral_engine.model.quant import QuantConfig, plan_quant, quant_config

AWQ = quantization_config("awq", 128)
GPTQ = quantization_config("gptq", 128)
W4A16 = quantization_config("w4a16", 128)
# A word whose nibble i (bits 4i..4i+3) holds the value i: 0x76543210.
COUNTING = 0x76543210
# Nibbles 15, 14, ..., 8 from nibble 0 up (0x89ABCDEF): the sign bit set, as int32 it is negative.
HIGH = 0x89ABCDEF - (1 << 32)


def test_the_three_formats_are_read_as_the_tools_write_them() -> None:
    awq = quant_config(None, AWQ)
    assert awq is not None and awq.is_int
    assert (awq.checkpoint, awq.bits, awq.group_size, awq.zero_point) == ("awq", 4, 128, True)
    gptq = quant_config("gptq", GPTQ)  # naming the checkpoint's own format asks for nothing more
    assert gptq is not None and gptq.method is None
    assert (gptq.checkpoint, gptq.bits, gptq.desc_act, gptq.zeros_minus_one) == ("gptq", 4, False, True)
    assert quant_config(None, {**GPTQ, "checkpoint_format": "gptq_v2"}).zeros_minus_one is False  # type: ignore[union-attr]
    ct = quant_config("compressed-tensors", W4A16)
    assert ct is not None and (ct.checkpoint, ct.bits, ct.group_size, ct.zero_point) == (
        "compressed-tensors",
        4,
        128,
        False,
    )
    assert ct.is_skipped("lm_head") and not ct.is_skipped("model.layers.0.mlp.up_proj")
    assert "groups of 128" in ct.describe()


def _w4a16_with(**weights: object) -> dict:
    group = W4A16["config_groups"]["group_0"]
    return {**W4A16, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**AWQ, "version": "gemv"}, "AWQ checkpoint version 'gemv' is not supported"),
        ({**AWQ, "bits": 3}, "only 4-bit"),
        ({**GPTQ, "bits": 3}, "GPTQ checkpoint with 3 bits"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({**GPTQ, "group_size": 0}, "group_size must be a positive integer or -1"),
        (_w4a16_with(num_bits=2), "int 2-bit weights"),
        (_w4a16_with(strategy="tensor"), "weight strategy 'tensor'"),
        (
            {
                **W4A16,
                "config_groups": {
                    "group_0": {
                        **W4A16["config_groups"]["group_0"],
                        "input_activations": {"type": "int", "num_bits": 8},
                    }
                },
            },
            "quantized activations",
        ),
    ],
)
def test_variants_corral_cannot_load_are_refused_saying_what(raw: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        quant_config(None, raw)


def test_quantization_names_must_match_the_checkpoint() -> None:
    with pytest.raises(ModelLoadError, match=r"--quantization awq contradicts config.json.*'gptq'"):
        quant_config("awq", GPTQ)
    with pytest.raises(ModelLoadError, match=r"--quantization int8 contradicts config.json.*'awq'"):
        quant_config("int8", AWQ)
    with pytest.raises(ModelLoadError, match="--quantization gptq names a checkpoint format"):
        quant_config("gptq", None)
    with pytest.raises(ModelLoadError, match=r"--quantization awq contradicts config.json.*'fp8'"):
        quant_config("awq", {"quant_method": "fp8"})


def test_each_device_runs_int4_or_dequantizes_saying_why() -> None:
    config = QuantConfig(checkpoint="awq", bits=4, group_size=128, zero_point=True)
    assert plan_quant(config, "cpu", None, "bfloat16", True).weights == "int4"
    f32 = plan_quant(config, "cpu", None, "float32", True)
    assert f32.weights is None and "slower than a dense matmul" in f32.note and not f32.is_warning
    assert plan_quant(config, "cpu", None, "float32", True, int4_switch="1").weights == "int4"
    assert plan_quant(config, "cpu", None, "bfloat16", True, int4_switch="0").weights is None
    assert plan_quant(config, "cuda", (9, 0), "bfloat16", True, True).weights == "int4"
    old = plan_quant(config, "cuda", (7, 5), "bfloat16", True, False)
    assert old.weights is None and old.is_warning and "does not run on this GPU" in old.note
    assert plan_quant(config, "cuda", (9, 0), "float16", True, True, "1").weights is None  # tinygemm: bf16
    eight = QuantConfig(checkpoint="gptq", bits=8, group_size=128, zero_point=True)
    assert plan_quant(eight, "cpu", None, "bfloat16", True).weights is None


def test_which_shapes_the_int4_kernel_takes() -> None:
    assert int4_fits(4096, 4096, 128) and int4_fits(64, 128, 32) and int4_fits(512, 64, -1)
    assert int4_fits(1024, 64, 512)  # a larger group runs as several kernel groups of 256
    assert not int4_fits(64, 24, 32)  # outputs: a multiple of 16
    assert not int4_fits(64, 64, 16)  # groups of 32 to 256 only
    assert not int4_fits(96, 64, 64)  # a group cut in two


def test_awq_words_decode_in_the_interleaved_order() -> None:
    # One input row, eight outputs: nibble i is output column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7).
    qweight = torch.tensor([[COUNTING]], dtype=torch.int32)  # [in 1, out/8 1]
    qzeros = torch.tensor([[HIGH]], dtype=torch.int32)
    unpacked = unpack_awq(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), 1)
    assert unpacked.q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpacked.zero[:, 0].tolist() == [15, 11, 14, 10, 13, 9, 12, 8]


def test_gptq_words_decode_along_the_inputs_and_zeros_along_the_outputs() -> None:
    # qweight [in/8 1, out 2]: word r nibble j is input row 8r + j; zeros hold z - 1 (v1).
    qweight = torch.tensor([[COUNTING, HIGH]], dtype=torch.int32)
    qzeros = torch.tensor([[0x77777777]], dtype=torch.int32)  # [groups 1, out/8 1]: eight outputs
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    q8 = torch.cat([qweight, torch.zeros(1, 6, dtype=torch.int32)], dim=1)
    unpacked = unpack_gptq(q8, qzeros, scales, None, 4, zeros_minus_one=True)
    assert unpacked.q[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert unpacked.q[1].tolist() == [15, 14, 13, 12, 11, 10, 9, 8]
    assert unpacked.zero[:, 0].tolist() == [8.0] * 8
    assert unpacked.dequantized()[0].tolist() == [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5]
    v2 = unpack_gptq(q8, qzeros, scales, None, 4, zeros_minus_one=False)
    assert v2.zero[0, 0] == 7.0


def test_gptq_act_order_puts_each_input_in_its_g_idx_group() -> None:
    qweight = torch.full((2, 8), COUNTING, dtype=torch.int32)  # 16 inputs, 8 outputs
    scales = torch.tensor([[1.0] * 8, [2.0] * 8], dtype=torch.float16)  # groups of 8
    qzeros = torch.zeros((2, 1), dtype=torch.int32)  # z - 1 = 0: zero 1
    g_idx = torch.tensor([1, 0] * 8, dtype=torch.int32)
    unpacked = unpack_gptq(qweight, qzeros, scales, g_idx, 4, zeros_minus_one=True)
    assert unpacked.contiguous_groups(8) is None
    # input row i: value i % 8, group g_idx[i]: (v - 1) * (2 if odd group else 1)
    expected = [(i % 8 - 1) * (2.0 if g_idx[i] == 1 else 1.0) for i in range(16)]
    assert unpacked.dequantized()[0].tolist() == expected


def test_compressed_tensors_words_decode_along_the_inputs_offset_by_eight() -> None:
    packed = torch.tensor([[COUNTING], [HIGH]], dtype=torch.int32)  # [out 2, in/8 1]
    scale = torch.tensor([[2.0], [1.0]])
    sym = unpack_compressed(packed, scale, (2, 8), None, None, 4)
    assert sym.dequantized().tolist() == [
        [-16.0, -14.0, -12.0, -10.0, -8.0, -6.0, -4.0, -2.0],
        [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
    ]
    # Asymmetric: zero points packed along the outputs (two in one word: 9 and 10, + 8 each).
    zero_point = torch.tensor([[0xA9]], dtype=torch.int32)  # [ceil(out/8) 1, groups 1]
    asym = unpack_compressed(packed, scale, (2, 8), zero_point, None, 4)
    assert asym.zero[:, 0].tolist() == [9.0, 10.0]
    # A weight whose inputs do not fill the last word (12 of 16): the padding is dropped.
    padded = unpack_compressed(
        torch.tensor([[COUNTING, COUNTING]], dtype=torch.int32), scale[:1], (1, 12), None, None, 4
    )
    assert padded.q.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]


def _int4_linear(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype
) -> Linear:
    out, cols = q.shape
    with torch.device("meta"):
        linear = Linear(cols, out, bias=True)
    linear.quantize("int4", group)
    linear = linear.to_empty(device="cpu")
    with torch.no_grad():
        linear.weight.copy_(pack_nibbles(q))
        linear.get_buffer("weight_scale").copy_(scale)
        linear.get_buffer("weight_zero").copy_(zero)
        linear.bias.copy_(torch.linspace(-1, 1, out))
    linear.quantized_ready(dtype)
    return linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [32, 64, 256])  # 256: the kernel runs groups of 256 with equal scales
def test_the_int4_linear_matches_f_linear_on_its_dequantized_weight(dtype: torch.dtype, group: int) -> None:
    gen = torch.Generator().manual_seed(0)
    out, cols = 48, 256
    q = torch.randint(0, 16, (out, cols), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out, cols // group, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, (out, cols // group), generator=gen).float()
    linear = _int4_linear(q, scale, zero, group, dtype)
    groups = torch.arange(cols) // group
    weight = (q.float() - zero[:, groups]) * scale[:, groups]  # [out, in]: the plain rule
    x = torch.randn(5, cols, generator=gen)
    expected = F.linear(x, weight, linear.bias.float())
    got = linear(x.to(dtype)).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert linear(x[:0].to(dtype)).shape == (0, out)
    assert linear.weight.nbytes == out * cols // 2  # two weights a byte


def test_eight_bit_words_hold_four_values() -> None:
    # GPTQ 8-bit: qweight [in/4, out], byte j of word r is input row 4r + j; zeros stored minus one.
    qweight = torch.tensor([[0x04030201, 0xFF800000 - (1 << 32)]], dtype=torch.int32)  # [1, out 2]
    qzeros = torch.tensor([[0x7F7F]], dtype=torch.int32)  # [groups 1, 1 word]: two outputs' 127
    scales = torch.ones((1, 2), dtype=torch.float16)
    unpacked = unpack_gptq(qweight, qzeros, scales, None, 8, True)
    assert unpacked.q.tolist() == [[1, 2, 3, 4], [0, 0, 128, 255]]
    assert unpacked.zero[:, 0].tolist() == [128.0, 128.0]
