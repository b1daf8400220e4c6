"""Quantized weights end to end on the CPU: an FP8 checkpoint (as `corral demo-model --quantization
fp8` writes it) gives transformers' greedy tokens on its own dequantization; --quantization int8
gives transformers' on the int8 weights dequantized (q * scale), alone, under LoRA (peft) and over
two tensor-parallel ranks; its weights take a quarter of float32's bytes; methods Corral cannot
serve stop the engine at start-up, and `corral engine` exits saying why."""

from __future__ import annotations

import json
import pathlib
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.demo_model import write_demo_model
from corral_engine.errors import ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.lora import LoraRequest
from corral_engine.model.llama import CausalLM, FusedLinear, Linear
from corral_engine.model.quant_ops import quantize_rows
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
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_model(tmp_path_factory.mktemp("fp8") / "tiny-fp8", preset="tiny", quantization="fp8")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, 500, seed=5)


def _generate(
    engine: LLMEngine, prompts: list[list[int]], lora: LoraRequest | None = None
) -> list[list[int]]:
    return generate_in_order(engine, prompts, GREEDY, lora)


def _projections(model: CausalLM) -> list[Linear]:
    return [
        getattr(m, n)
        for layer in model.model.layers
        for m in (layer.self_attn, layer.mlp)
        for n in PROJECTIONS
        if hasattr(m, n)
    ]


def _engine_weights(model: CausalLM, source: pathlib.Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights with the engine's projections in place of its own, quantized ones
    as q * scale (float32); the rest (embeddings, LM head, norms) as the checkpoint has them."""
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if not k.endswith("_scale_inv")}  # noqa: SIM118
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        weight = module.weight.float()
        if module.quant is not None:
            weight = weight * module.get_buffer("weight_scale")[:, None]
        parent = name.rsplit(".", 1)[0]
        shards = (
            module.shard_offsets
            if isinstance(module, FusedLinear)
            else {name.rsplit(".", 1)[1]: (0, len(weight))}
        )
        for shard, (offset, size) in shards.items():
            state[f"{parent}.{shard}.weight"] = weight[offset : offset + size].clone()
    return state


def _checkpoint_of(state: dict[str, torch.Tensor], like: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A plain float32 checkpoint of `state` with `like`'s tokenizer and config (unquantized)."""
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(like / name, out / name)
    config = json.loads((like / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def test_an_fp8_checkpoint_gives_transformers_tokens_on_its_dequantization(
    fp8_dir: pathlib.Path, prompts: list[list[int]]
) -> None:
    # transformers on a CPU dequantizes FP8 checkpoints at load (q * scale in float32), as Corral does.
    expected = transformers_greedy(fp8_dir, prompts, MAX_NEW)
    assert _generate(make_engine(fp8_dir), prompts) == expected
    assert _generate(make_engine(fp8_dir, max_num_batched_tokens=7), prompts) == expected


def test_int8_gives_transformers_tokens_on_the_int8_weights(
    tiny_model_dir: pathlib.Path, fp8_dir: pathlib.Path, prompts: list[list[int]], tmp_path: pathlib.Path
) -> None:
    for source in (tiny_model_dir, fp8_dir):  # a float32 checkpoint, and an FP8 one requantized per row
        engine = make_engine(source, quantization="int8")
        layers = _projections(engine.runner.model)
        assert len(layers) == 8 and all(
            lin.quant == "int8" and lin.weight.dtype == torch.int8 for lin in layers
        )
        reference = _checkpoint_of(
            _engine_weights(engine.runner.model, source), source, tmp_path / source.name
        )
        expected = transformers_greedy(reference, prompts, MAX_NEW)
        assert _generate(engine, prompts) == expected
        chunked = make_engine(source, quantization="int8", max_num_batched_tokens=7)
        assert _generate(chunked, prompts) == expected
        if source == tiny_model_dir:  # int8 rounding changes some tokens: not the float32 weights' outputs
            assert expected != transformers_greedy(source, prompts, MAX_NEW)


def test_int8_weights_take_a_quarter_of_float32_and_half_of_bf16(tiny_model_dir: pathlib.Path) -> None:
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        for quantization in (None, "int8"):
            # Unpacked, so the plain layers hold their weights as tensors that can be measured.
            engine = make_engine(
                tiny_model_dir, EngineSettings(prepack="0"), dtype=dtype, quantization=quantization
            )
            sizes[dtype, quantization] = sum(lin.weight.nbytes for lin in _projections(engine.runner.model))
            # The embeddings, LM head and norms keep the model dtype.
            assert engine.runner.model.lm_head.weight.dtype == getattr(torch, dtype)
    assert sizes["float32", "int8"] * 4 == sizes["float32", None]
    assert sizes["bfloat16", "int8"] * 2 == sizes["bfloat16", None]
    assert sizes["float32", "int8"] == sizes["bfloat16", "int8"]


def test_quantized_layers_skip_prepacking_and_the_native_decode_stack(tiny_model_dir: pathlib.Path) -> None:
    settings = EngineSettings(prepack="1", small_batch_kernel="1")
    engine = make_engine(tiny_model_dir, settings, dtype="bfloat16", quantization="int8")
    model = engine.runner.model
    assert all(lin.packed is None and lin.upcast_packed is None for lin in _projections(model))
    assert model.decode_stack is None
    assert _generate(engine, [[5, 6, 7]])  # and it runs


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "a", rank=8, seed=1)


def test_lora_over_an_int8_base_matches_peft_over_its_dequantization(
    tiny_model_dir: pathlib.Path, adapter: pathlib.Path, prompts: list[list[int]], tmp_path: pathlib.Path
) -> None:
    engine = make_engine(
        tiny_model_dir, quantization="int8", enable_lora=True, lora_modules=(f"a={adapter}",)
    )
    reference = _checkpoint_of(
        _engine_weights(engine.runner.model, tiny_model_dir), tiny_model_dir, tmp_path / "ref"
    )
    expected = peft_greedy(reference, adapter, prompts[:4], MAX_NEW)
    assert expected != peft_greedy(reference, None, prompts[:4], MAX_NEW)  # the adapter changes outputs
    assert _generate(engine, prompts[:4], LoraRequest("a", 1, str(adapter))) == expected


def _rank_local_int8(state: dict[str, torch.Tensor], num_ranks: int) -> dict[str, torch.Tensor]:
    """Weights as `num_ranks` ranks hold them quantized: rows are rows whatever the rank, but the
    row-parallel o_proj and down_proj quantize each rank's slice of the columns on its own."""
    out = dict(state)
    for name, w in state.items():
        if not any(
            f".{p}." in name
            for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        ):
            continue
        pieces = w.chunk(num_ranks, dim=1) if (".o_proj." in name or ".down_proj." in name) else (w,)
        quantized = [quantize_rows(p, torch.int8) for p in pieces]
        out[name] = torch.cat([q.float() * s[:, None] for q, s in quantized], dim=1)
    return out


@pytest.mark.slow
def test_two_ranks_over_int8_and_over_an_fp8_checkpoint(
    tiny_model_dir: pathlib.Path, fp8_dir: pathlib.Path, prompts: list[list[int]], tmp_path: pathlib.Path
) -> None:
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    reference = _checkpoint_of(_rank_local_int8(state, 2), tiny_model_dir, tmp_path / "ref")
    engine = make_engine(tiny_model_dir, quantization="int8", tensor_parallel_size=2)
    try:
        assert _generate(engine, prompts) == transformers_greedy(reference, prompts, MAX_NEW)
    finally:
        engine.runner.close()
    engine = make_engine(fp8_dir, tensor_parallel_size=2)  # each rank dequantizes its slices
    try:
        assert _generate(engine, prompts) == transformers_greedy(fp8_dir, prompts, MAX_NEW)
    finally:
        engine.runner.close()


def _with_quantization(src: pathlib.Path, out: pathlib.Path, quantization: dict) -> pathlib.Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return out


BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
GGUF = {"quant_method": "gguf"}


@pytest.mark.parametrize(("name", "quantization"), [("bitsandbytes", BNB), ("gguf", GGUF)])
def test_methods_corral_does_not_serve_stop_the_engine_saying_why(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, name: str, quantization: dict
) -> None:
    model_dir = _with_quantization(tiny_model_dir, tmp_path / name, quantization)
    with pytest.raises(ModelLoadError, match=f"quantization method '{name}' in config.json is not supported"):
        make_engine(model_dir)
    with pytest.raises(ModelLoadError, match=f"--quantization int8 contradicts config.json.*'{name}'"):
        make_engine(model_dir, quantization="int8")


def test_quantizing_experts_is_refused(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        make_engine(tiny_model_dirs["qwen3-moe"], quantization="int8")


@pytest.fixture
def free_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port


def test_the_http_server_exits_saying_the_method_is_not_supported(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, free_port: int
) -> None:
    model_dir = _with_quantization(tiny_model_dir, tmp_path / "bnb", BNB)
    argv = [
        sys.executable,
        "-m",
        "corral_cli.main",
        "engine",
        "--model",
        str(model_dir),
        "--port",
        str(free_port),
    ]
    argv += ["--host", "127.0.0.1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert (
        "cannot load the model: quantization method 'bitsandbytes' in config.json is not supported"
        in done.stderr
    )
