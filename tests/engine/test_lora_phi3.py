"""LoRA adapters on a Phi-3 base, whose transformers modules (so PEFT's targets) are the fused
qkv_proj and gate_up_proj: greedy float32 tokens of a batch mixing adapters and the base model equal
transformers + peft's; an adapter naming the other kind of module is refused by name."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import pytest
import torch
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.sampling_params import SamplingParams
from safetensors import safe_open

from tests.engine.helpers import make_engine, peft_greedy, random_prompts, run_checked

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
NAMES = ["all", None, "some", "all", "some", None]  # each prompt's adapter (None: the base model)
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="module")
def phi3_dir(tiny_model_dirs: Mapping[str, pathlib.Path]) -> pathlib.Path:
    return tiny_model_dirs["phi3"]


@pytest.fixture(scope="module")
def adapters(phi3_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """ "all": every module the base has (rank 8); "some": the fused attention input and a
    row-parallel one (rank 4)."""
    root = tmp_path_factory.mktemp("phi3-adapters")
    return {
        "all": write_demo_adapter(phi3_dir, root / "all", rank=8, seed=1),
        "some": write_demo_adapter(
            phi3_dir, root / "some", rank=4, alpha=8, seed=2, targets=("qkv_proj", "down_proj")
        ),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(NAMES), 500, seed=11, max_len=40)


@pytest.fixture(scope="module")
def expected(
    phi3_dir: pathlib.Path, adapters: dict[str, pathlib.Path], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    refs = {name: peft_greedy(phi3_dir, path, prompts, MAX_NEW) for name, path in adapters.items()}
    refs[None] = peft_greedy(phi3_dir, None, prompts, MAX_NEW)
    assert refs["all"] != refs[None] and refs["some"] != refs[None]  # the adapters change tokens
    return refs


def _shapes(path: pathlib.Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


def test_the_demo_adapter_names_the_modules_peft_finds_in_phi3(
    phi3_dir: pathlib.Path, adapters: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="q_proj"):  # transformers' Phi-3 has no split projections
        get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    model = AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=8, target_modules=FUSED)).save_pretrained(tmp_path / "peft")
    config = json.loads((adapters["all"] / "adapter_config.json").read_text())
    assert config["target_modules"] == FUSED
    # The same tensors, of the same shapes: B of qkv_proj has q + 2 kv rows, gate_up_proj's 2 I.
    shapes = _shapes(adapters["all"])
    assert shapes == _shapes(tmp_path / "peft")
    assert shapes["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"] == (64 + 2 * 32, 8)
    assert shapes["base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight"] == (2 * 128, 8)


@pytest.mark.parametrize("max_loras", [4, 1], ids=["slots-for-all", "one-slot"])
def test_batch_mixing_phi3_adapters_and_the_base_matches_peft(  # type: ignore[no-untyped-def]
    phi3_dir, adapters, prompts, expected, max_loras
) -> None:
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    engine = make_engine(phi3_dir, enable_lora=True, lora_modules=modules, max_loras=max_loras)
    loras = {None: None, **{n: LoraRequest(n, i, str(p)) for i, (n, p) in enumerate(adapters.items(), 1)}}
    for i, (prompt, name) in enumerate(zip(prompts, NAMES, strict=True)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora=loras[name])
    final = run_checked(engine)
    assert [final[f"r{i}"] for i in range(len(NAMES))] == [expected[n][i] for i, n in enumerate(NAMES)]


def test_an_adapter_naming_the_other_kind_of_module_is_refused_by_name(
    phi3_dir: pathlib.Path, tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    split = write_demo_adapter(phi3_dir, tmp_path / "split", rank=4, targets=("q_proj", "v_proj", "o_proj"))
    engine = make_engine(phi3_dir, enable_lora=True)
    with pytest.raises(
        AdapterError,
        match=r"adapter 'split': target modules q_proj, v_proj are not modules of this Phi3ForCausalLM "
        r"base model, whose adapters target qkv_proj, o_proj, gate_up_proj, down_proj",
    ):
        engine.add_lora(LoraRequest("split", 1, str(split)))
    fused = write_demo_adapter(tiny_model_dir, tmp_path / "fused", rank=4, targets=("qkv_proj", "down_proj"))
    engine = make_engine(tiny_model_dir, enable_lora=True)
    with pytest.raises(AdapterError, match=r"adapter 'fused': target modules qkv_proj are not modules"):
        engine.add_lora(LoraRequest("fused", 1, str(fused)))
