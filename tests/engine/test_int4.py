"""int4 weight-only checkpoints end to end on the CPU: AWQ, GPTQ (with act-order too) and
compressed-tensors W4A16, as `corral demo-model --quantization awq|gptq|w4a16` writes them, give
transformers' greedy tokens on their dequantized float weights, built here from the packed words
by each format's documented rule (not the engine's unpacking): dequantized at load (float32) and
through the int4 kernel (CORRAL_INT4_KERNEL=1), alone, under LoRA (peft) and over two ranks; int4
weights take a quarter of bf16's bytes; refused variants stop `corral engine` saying why."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.demo_int4 import quantization_config, quantize_checkpoint
from corral_engine.demo_model import write_demo_model
from corral_engine.errors import ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.lora import LoraRequest
from corral_engine.model.llama import Linear
from corral_engine.model.quant_layers import quantized_bytes
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from safetensors import safe_open
from safetensors.torch import save_file

from tests.engine.helpers import (
    generate_in_order,
    make_engine,
    peft_greedy,
    random_prompts,
    transformers_greedy,
)

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FORMATS = ("awq", "gptq", "w4a16")
KERNEL = EngineSettings(int4_kernel="1")  # float32 activations through the int4 kernel
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("int4")
    return {fmt: write_demo_model(root / fmt, preset="tiny", quantization=fmt) for fmt in FORMATS}


@pytest.fixture(scope="module")
def references(
    int4_dirs: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("int4-ref")
    return {fmt: _dequantized_checkpoint(d, root / fmt) for fmt, d in int4_dirs.items()}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 500, seed=7)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int64 [..., W, 8]: value i from bits 4i..4i+3 of each word."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 15 for i in range(8)], dim=-1)


def _awq_float(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    def columns(words: torch.Tensor) -> torch.Tensor:  # nibble i of word c is column 8c + AWQ_ORDER[i]
        n = _nibbles(words)
        out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
        for i, column in enumerate(AWQ_ORDER):
            out[:, column::8] = n[:, :, i]
        return out

    q, z = columns(t["qweight"]), columns(t["qzeros"]).repeat_interleave(group, 0)
    return ((q - z) * t["scales"].float().repeat_interleave(group, 0)).t()  # [out, in]


def _gptq_float(t: dict[str, torch.Tensor]) -> torch.Tensor:
    q = _nibbles(t["qweight"]).permute(0, 2, 1).reshape(-1, t["qweight"].shape[1])  # row 8r + j
    z = _nibbles(t["qzeros"]).reshape(t["qzeros"].shape[0], -1) + 1  # stored z - 1
    g = t["g_idx"].long()
    return ((q - z[g]) * t["scales"].float()[g]).t()


def _w4a16_float(t: dict[str, torch.Tensor]) -> torch.Tensor:
    out, cols = t["weight_shape"].tolist()
    q = _nibbles(t["weight_packed"]).reshape(out, -1)[:, :cols] - 8  # signed values stored + 8
    scale = t["weight_scale"].float()
    return q * scale.repeat_interleave(cols // scale.shape[1], 1)


def _dequantized_checkpoint(src: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A plain float32 checkpoint of `src`'s dequantized weights, with its tokenizer and config."""
    config = json.loads((src / "config.json").read_text())
    quant = config.pop("quantization_config")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    state: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.endswith(
            ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape")
        ):
            module, part = name.rsplit(".", 1)
            modules.setdefault(module, {})[part] = tensor
        else:
            state[name] = tensor
    for module, t in modules.items():
        if "qweight" in t and "g_idx" in t:
            weight = _gptq_float(t)
        elif "qweight" in t:
            weight = _awq_float(t, quant["group_size"])
        else:
            weight = _w4a16_float(t)
        state[f"{module}.weight"] = weight.float().contiguous()
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, str(out / "model.safetensors"))
    return out


def _generate(
    engine: LLMEngine, prompts: list[list[int]], lora: LoraRequest | None = None
) -> list[list[int]]:
    return generate_in_order(engine, prompts, GREEDY, lora)


def _int4_layers(engine: LLMEngine) -> list[Linear]:
    return [m for m in engine.runner.model.modules() if isinstance(m, Linear) and m.quant == "int4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_gives_transformers_tokens_on_its_dequantized_weights(
    fmt: str,
    int4_dirs: dict[str, pathlib.Path],
    references: dict[str, pathlib.Path],
    tiny_model_dir: pathlib.Path,
    prompts: list[list[int]],
) -> None:
    expected = transformers_greedy(references[fmt], prompts, MAX_NEW)
    assert expected != transformers_greedy(tiny_model_dir, prompts, MAX_NEW)  # int4 rounding shows
    dequantized = make_engine(int4_dirs[fmt])  # float32: dequantized at load
    assert not _int4_layers(dequantized)
    assert _generate(dequantized, prompts) == expected
    kernel = make_engine(int4_dirs[fmt], KERNEL, max_num_batched_tokens=7)
    assert len(_int4_layers(kernel)) == 8
    assert _generate(kernel, prompts) == expected


def test_bf16_runs_int4_weights_in_a_quarter_of_bf16s_bytes(
    int4_dirs: dict[str, pathlib.Path], references: dict[str, pathlib.Path]
) -> None:
    settings = EngineSettings(prepack="0")  # plain layers keep weights that can be measured
    plain = make_engine(references["awq"], settings, dtype="bfloat16")
    layers = [m for n, m in plain.runner.model.named_modules() if isinstance(m, Linear) and "layers." in n]
    plain_bytes = sum(lin.weight.nbytes for lin in layers)
    engine = make_engine(int4_dirs["awq"], settings, dtype="bfloat16")
    int4 = _int4_layers(engine)
    assert len(int4) == 8 and all(lin.weight.dtype == torch.uint8 for lin in int4)
    assert sum(lin.weight.nbytes for lin in int4) * 4 == plain_bytes
    # scales and zeros: two bf16 per group of 32 weights (+ 1/8 byte a weight)
    assert quantized_bytes(int4) <= 0.32 * plain_bytes
    assert engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert _generate(engine, [[5, 6, 7]])


def test_gptq_act_order_layers_are_dequantized_and_give_transformers_tokens(
    tiny_model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    prompts: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    src = tmp_path / "act"
    shutil.copytree(tiny_model_dir, src)
    quantize_checkpoint(src, "gptq", 32, act_order=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config("gptq", 32, act_order=True)
    (src / "config.json").write_text(json.dumps(config))
    expected = transformers_greedy(_dequantized_checkpoint(src, tmp_path / "ref"), prompts, MAX_NEW)
    with caplog.at_level(logging.INFO, logger="corral_engine.model.loader"):
        engine = make_engine(src, KERNEL)
    assert not _int4_layers(engine)  # a g_idx scattering groups: dequantized at load, said so
    assert "8 int4 layers dequantized to float32 at load (act-order groups" in caplog.text
    assert _generate(engine, prompts) == expected


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "a", rank=8, seed=1)


def test_lora_over_an_int4_base_matches_peft_over_its_dequantization(
    int4_dirs: dict[str, pathlib.Path],
    references: dict[str, pathlib.Path],
    adapter: pathlib.Path,
    prompts: list[list[int]],
) -> None:
    engine = make_engine(int4_dirs["awq"], KERNEL, enable_lora=True, lora_modules=(f"a={adapter}",))
    assert len(_int4_layers(engine)) == 8
    expected = peft_greedy(references["awq"], adapter, prompts[:4], MAX_NEW)
    assert expected != peft_greedy(references["awq"], None, prompts[:4], MAX_NEW)
    assert _generate(engine, prompts[:4], LoraRequest("a", 1, str(adapter))) == expected


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq", "w4a16"])
def test_two_ranks_over_an_int4_checkpoint(
    fmt: str,
    int4_dirs: dict[str, pathlib.Path],
    references: dict[str, pathlib.Path],
    prompts: list[list[int]],
) -> None:
    expected = transformers_greedy(references[fmt], prompts, MAX_NEW)
    for settings in (None, KERNEL):  # each rank dequantizes its cut, or runs its cut's int4 groups
        engine = make_engine(int4_dirs[fmt], settings, tensor_parallel_size=2)
        try:
            assert _generate(engine, prompts) == expected
        finally:
            engine.runner.close()


def test_the_http_server_exits_saying_the_variant_is_not_supported(
    int4_dirs: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    model_dir = tmp_path / "gemv"
    shutil.copytree(int4_dirs["awq"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (model_dir / "config.json").write_text(json.dumps(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(model_dir)]
    argv += ["--port", str(port), "--host", "127.0.0.1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "cannot load the model: AWQ checkpoint version 'gemv' is not supported (only gemm)" in done.stderr


def test_plain_weights_under_an_int4_config_are_refused(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model_dir = tmp_path / "claims-awq"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config("awq", 32)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"layers.0.mlp.down_proj.weight. holds plain weights.*\(awq\)"):
        make_engine(model_dir)


def test_compressed_tensors_itself_reads_the_w4a16_checkpoint_as_the_engine_does(
    int4_dirs: dict[str, pathlib.Path], prompts: list[list[int]]
) -> None:
    # An independent reader of pack-quantized: transformers with the compressed-tensors package
    # decompresses the checkpoint to float32 weights.
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from bench.gpu import reference

    model = AutoModelForCausalLM.from_pretrained(
        int4_dirs["w4a16"], dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    expected = reference.transformers_greedy(model, prompts, MAX_NEW)
    assert _generate(make_engine(int4_dirs["w4a16"]), prompts) == expected
    assert _generate(make_engine(int4_dirs["w4a16"], KERNEL), prompts) == expected
