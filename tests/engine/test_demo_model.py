"""`corral demo-model`: real, loadable, deterministic checkpoints with a local byte-level tokenizer."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
import torch
from corral_cli.main import main as corral_main
from corral_engine.demo_model import (
    ARCHITECTURES,
    build_config_dict,
    count_parameters,
    write_demo_model,
)
from corral_engine.demo_tokenizer import EOS_TOKEN_ID
from corral_engine.sim.host import eos_token_ids
from corral_engine.sim.tokenizer import LightTokenizer
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
TEXTS = (
    "Hello world, the quick brown fox.",
    "Café naïve résumé — 😀🚀 你好，世界。こんにちは",
    "def f(x):\n    return x + 1\n\n\ttabs  and   spaces ",
)


def _digests(path: pathlib.Path) -> dict[str, str]:
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in FILES}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_loads_with_transformers_and_generates(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())

    assert type(model).__name__ == ARCHITECTURES[arch] == config["architectures"][0]
    assert len(tok) == config["vocab_size"] == model.get_input_embeddings().weight.shape[0]
    assert tok.eos_token_id == config["eos_token_id"] == EOS_TOKEN_ID
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == EOS_TOKEN_ID
    assert tok.bos_token_id is not None and tok.pad_token_id is not None

    ids = tok("the quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


def test_arch_specific_shapes(tiny_model_dirs):
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    assert qwen2.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # random, not zero-initialised

    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"])
    cfg = qwen3.config
    assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads  # explicit head_dim is exercised
    assert qwen3.model.layers[0].self_attn.q_norm.weight.shape == (cfg.head_dim,)
    assert not torch.allclose(qwen3.model.layers[0].self_attn.q_norm.weight, torch.ones(cfg.head_dim))


def test_greedy_top1_is_not_a_near_tie(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("Once upon a time there was a small cat", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]  # [seq, vocab]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3


def test_same_seed_writes_identical_files_and_other_seed_differs(tmp_path, tiny_model_dir):
    again = write_demo_model(tmp_path / "again", preset="tiny", seed=0)
    assert _digests(again) == _digests(tiny_model_dir)
    other = _digests(write_demo_model(tmp_path / "other", preset="tiny", seed=1))
    assert other["model.safetensors"] != _digests(tiny_model_dir)["model.safetensors"]
    assert other["tokenizer.json"] != _digests(tiny_model_dir)["tokenizer.json"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_round_trips_utf8(tiny_model_dirs, arch):
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs[arch])
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False).input_ids
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text


def test_chat_template_renders(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(tok.bos_token)
    assert "Be brief." in text and "Hi there" in text
    assert text.endswith("<|assistant|>\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.eos_token_id) == 2


def test_config_overrides(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0}
    overrides = {
        "tie_word_embeddings": True,
        "attention_bias": True,
        "num_hidden_layers": 1,
        "rope_scaling": rope,
    }
    path = write_demo_model(tmp_path / "m", config_overrides=overrides)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 1
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.model.layers[0].self_attn.k_proj.bias is not None
    assert model.config.rope_parameters["rope_type"] == "linear"
    assert rope == {"rope_type": "linear", "factor": 2.0}  # the caller's dict is not mutated
    assert sum(p.numel() for p in model.parameters()) == count_parameters(
        build_config_dict("tiny", "llama", overrides)
    )


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_parameter_count_formula_matches_transformers(tiny_model_dirs, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch])
    assert sum(p.numel() for p in model.parameters()) == count_parameters(build_config_dict("tiny", arch))


def test_small_preset_is_about_110m_parameters():
    cfg = build_config_dict("small", "llama")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (768, 12, 32000)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (12, 4)
    assert 100e6 <= count_parameters(cfg) <= 120e6


def test_bad_preset_and_arch_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="supported"):
        write_demo_model(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="qwen3"):
        write_demo_model(tmp_path, arch="gpt2")


def test_cli_writes_a_checkpoint(tmp_path, tiny_model_dir):
    assert (
        corral_main(["demo-model", str(tmp_path / "cli"), "--preset", "tiny", "--seed", "0", "--quiet"]) == 0
    )
    assert _digests(tmp_path / "cli") == _digests(tiny_model_dir)


def test_weights_an_earlier_checkpoint_left_are_removed(tmp_path, tiny_model_dir):
    out = tmp_path / "reused"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    index = {"weight_map": {"x": "model-00002-of-00002.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    write_demo_model(out, preset="tiny", seed=0)
    assert _digests(out) == _digests(tiny_model_dir)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_model_dir.iterdir())


def test_no_weights_writes_what_the_simulator_reads_and_nothing_more(tmp_path, tiny_model_dir):
    out = tmp_path / "tokenizer-only"
    assert corral_main(["demo-model", str(out), "--preset", "tiny", "--no-weights", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    config, full_config = (json.loads((d / "config.json").read_text()) for d in (out, tiny_model_dir))
    for key in ("architectures", "vocab_size", "max_position_embeddings", "eos_token_id", "dtype"):
        assert config[key] == full_config[key]
    tokenizer = LightTokenizer(out)
    assert eos_token_ids(out, tokenizer) == (EOS_TOKEN_ID,)


def test_cli_says_in_one_line_why_it_cannot_write(tmp_path, caplog):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("x")
    assert corral_main(["demo-model", str(in_the_way), "--quiet"]) == 1
    assert "cannot write the checkpoint" in caplog.text


@pytest.mark.parametrize(
    ("arch", "expert_tensor"),
    [
        ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
        ("qwen3-moe", "model.layers.1.mlp.experts.3.down_proj.weight"),
    ],
)
def test_moe_checkpoints_hold_the_hubs_expert_by_expert_layout(
    tmp_path, tiny_model_dirs, arch, expert_tensor
):
    """What transformers' save_pretrained writes and hub checkpoints hold, not v5's fused in-memory
    tensors; the same seed writes the same bytes."""
    out = tmp_path / "cli"
    assert corral_main(["demo-model", str(out), "--arch", arch, "--quiet"]) == 0
    assert _digests(out) == _digests(tiny_model_dirs[arch])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert expert_tensor in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    config = json.loads((out / "config.json").read_text())
    assert config.get("num_local_experts", config.get("num_experts")) == 4
    assert config["num_experts_per_tok"] == 2


def test_qwen3_moe_parameter_count_with_dense_layers():
    cfg = build_config_dict("tiny", "qwen3-moe", {"mlp_only_layers": [1]})
    config = AutoConfig.for_model("qwen3_moe", **{k: v for k, v in cfg.items() if k != "dtype"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)


def test_a_preset_without_experts_is_refused(tmp_path, caplog):
    with pytest.raises(ValueError, match="no mixture-of-experts variant"):
        build_config_dict("llama3-8b", "mixtral")
    assert corral_main(["demo-model", str(tmp_path / "m"), "--preset", "llama3-8b", "--arch", "mixtral"]) == 2
    assert "no mixture-of-experts variant" in caplog.text


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_moe_checkpoints_with_tied_embeddings_are_written(tmp_path, arch):
    """The small preset ties its embeddings: a mixture-of-experts checkpoint of it is written (the
    head was missing from the state transformers loads) and holds no separate head."""
    out = write_demo_model(tmp_path / arch, "tiny", arch=arch, config_overrides={"tie_word_embeddings": True})
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names


def test_fp8_checkpoints_hold_the_hubs_fine_grained_fp8_layout(tmp_path, tiny_model_dir):
    # Through the CLI; intermediate 192: a second block of 128 rows that is ragged (64 rows).
    out = tmp_path / "fp8"
    assert corral_main(["demo-model", str(out), "--quantization", "fp8", "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    }
    assert AutoConfig.from_pretrained(out).quantization_config["quant_method"] == "fp8"
    ragged = write_demo_model(
        tmp_path / "ragged", quantization="fp8", config_overrides={"intermediate_size": 192}
    )
    with safe_open(str(ragged / "model.safetensors"), "pt") as f:
        up = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        assert up.dtype == torch.float8_e4m3fn and up.shape == (192, 64)
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale_inv").shape == (2, 1)
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv").shape == (1, 2)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32  # not quantized
        assert "lm_head.weight_scale_inv" not in f.keys()  # noqa: SIM118
    # the same random weights as the plain checkpoint of the same seed, within fp8's rounding
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(out / FILES[2]), "pt") as f:
        q, scale = f.get_tensor(name).float(), f.get_tensor(name + "_scale_inv")
    with safe_open(str(tiny_model_dir / FILES[2]), "pt") as f:
        want = f.get_tensor(name)
    assert (q * scale - want).abs().max() <= want.abs().max() / 16


def test_fp8_experts_are_refused(tmp_path, caplog):
    argv = ["demo-model", str(tmp_path / "m"), "--arch", "mixtral", "--quantization", "fp8", "--quiet"]
    assert corral_main(argv) == 2
    assert "dense architectures" in caplog.text


def test_cli_writes_an_embedding_model(tmp_path):
    """--embedding: Qwen3-Embedding's layout (sentence-transformers files, no LM head, AutoModel's
    tensor names); --base-model-class names Qwen3Model, which --runner auto serves as embeddings."""
    from corral_engine import EngineArgs, PoolingParams
    from corral_engine.llm_engine import LLMEngine
    from safetensors import safe_open

    out = tmp_path / "emb"
    argv = ["demo-model", str(out), "--arch", "qwen3", "--embedding", "mean", "--base-model-class", "--quiet"]
    assert corral_main(argv) == 0
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    assert (out / "2_Normalize").is_dir()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("lm_head", "model.")) for n in names)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    engine = LLMEngine(EngineArgs(model=str(out), dtype="float32", num_kv_blocks=16))
    assert engine.runner_type == "pooling" and engine.pooler_config is not None
    assert engine.pooler_config.pooling_type == "MEAN"
    (output,) = engine.generate([[5, 6, 7]], PoolingParams())
    assert output.embedding is not None and len(output.embedding) == 64


@pytest.mark.parametrize(
    ("fmt", "tensors"),
    [
        (
            "awq",
            {
                "qweight": ((64, 8), torch.int32),
                "qzeros": ((2, 8), torch.int32),
                "scales": ((2, 64), torch.float16),
            },
        ),
        (
            "gptq",
            {
                "qweight": ((8, 64), torch.int32),
                "qzeros": ((2, 8), torch.int32),
                "scales": ((2, 64), torch.float16),
                "g_idx": ((64,), torch.int32),
            },
        ),
        (
            "w4a16",
            {
                "weight_packed": ((64, 8), torch.int32),
                "weight_scale": ((64, 2), torch.float32),
                "weight_shape": ((2,), torch.int64),
            },
        ),
    ],
)
def test_int4_checkpoints_hold_each_tools_layout(tmp_path, fmt, tensors):
    # Through the CLI: the tiny preset's dims split into groups of 32 (whole on each of two ranks).
    out = tmp_path / fmt
    assert corral_main(["demo-model", str(out), "--quantization", fmt, "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert AutoConfig.from_pretrained(out).quantization_config["quant_method"] == config["quant_method"]
    if fmt == "awq":
        assert config == {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 32,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    elif fmt == "gptq":
        assert (config["bits"], config["group_size"], config["desc_act"], config["sym"]) == (
            4,
            32,
            False,
            True,
        )
        assert config["checkpoint_format"] == "gptq"
    else:
        group = config["config_groups"]["group_0"]
        assert config["format"] == group["format"] == "pack-quantized" and config["ignore"] == ["lm_head"]
        assert group["weights"]["num_bits"] == 4 and group["weights"]["group_size"] == 32
        assert group["input_activations"] is None
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for part, (shape, dtype) in tensors.items():
            t = f.get_tensor(f"model.layers.0.self_attn.q_proj.{part}")
            assert (tuple(t.shape), t.dtype) == (shape, dtype), part
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
