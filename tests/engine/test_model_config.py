"""config.json parsing for Phi-3, Gemma 3, Gemma 2, Granite and OLMo 2 (model/config.py) and
their rotary parameters (model/rotary.py): layer types and windows, rope per layer type, LongRoPE's
factor choice, partial rotary, the nested text_config of a multimodal Gemma 3, the checkpoint names
the loader maps, the families' multipliers and caps, and what is refused."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest
import torch
from corral_engine.errors import ModelLoadError
from corral_engine.model.config import ModelConfig, load_model_config
from corral_engine.model.loader import engine_name
from corral_engine.model.rotary import rope_parameters

GEMMA3_TEXT: dict[str, Any] = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 24,
    "vocab_size": 1024,
    "sliding_window": 16,
    "sliding_window_pattern": 2,  # the older configs' form: every 2nd layer global
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "eos_token_id": [1, 106],
}
PHI3: dict[str, Any] = {
    "model_type": "phi3",
    "architectures": ["Phi3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "sliding_window": 48,
}


def _config(tmp_path: pathlib.Path, raw: dict[str, Any]) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_model_config(tmp_path)


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))


def test_phi3_applies_its_window_to_every_layer(tmp_path: pathlib.Path) -> None:
    config = _config(tmp_path, PHI3)
    assert config.sliding_windows == (48, 48)
    assert (config.rotary_dim, config.rope_kinds, config.gemma, config.hidden_act) == (None, (), None, "silu")
    assert _config(tmp_path, {**PHI3, "sliding_window": None}).sliding_windows == (None, None)


def test_gemma3_layer_types_from_the_pattern_and_its_math(tmp_path: pathlib.Path) -> None:
    config = _config(tmp_path, GEMMA3_TEXT)
    assert config.rope_kinds == ("sliding_attention", "full_attention") * 2
    assert config.sliding_windows == (16, None, 16, None)
    assert config.rope_kind_set == ("sliding_attention", "full_attention")
    assert config.qk_norm and config.hidden_act == "gelu_pytorch_tanh"
    assert config.attention_scale == 24**-0.5  # query_pre_attn_scalar, not head_dim
    assert config.gemma is not None and config.gemma.embed_scale == 8.0
    assert config.eos_token_ids == (1, 106) and config.tie_word_embeddings


def test_gemma3_layer_types_listed_win_over_the_pattern(tmp_path: pathlib.Path) -> None:
    layer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    config = _config(tmp_path, {**GEMMA3_TEXT, "layer_types": layer_types})
    assert config.rope_kinds == tuple(layer_types)
    assert config.sliding_windows == (16, 16, 16, None)


def test_gemma3_rope_per_layer_type(tmp_path: pathlib.Path) -> None:
    """Local layers: rope_local_base_freq; global ones: rope_theta, with Gemma 3 4B+'s linear
    factor 8 where rope_scaling sets it (the local ones stay unscaled)."""
    config = _config(tmp_path, GEMMA3_TEXT)
    local, local_scaling = rope_parameters(config, "sliding_attention")
    full, _ = rope_parameters(config, "full_attention")
    assert torch.equal(local, _inv_freq(10_000.0, 32)) and local_scaling == 1.0
    assert torch.equal(full, _inv_freq(1_000_000.0, 32))
    scaled = _config(tmp_path, {**GEMMA3_TEXT, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert torch.allclose(rope_parameters(scaled, "full_attention")[0], _inv_freq(1_000_000.0, 32) / 8)
    assert torch.equal(rope_parameters(scaled, "sliding_attention")[0], local)


def test_longrope_factors_by_the_engine_context_and_partial_rotary(tmp_path: pathlib.Path) -> None:
    short, long = [1.0 + 0.1 * i for i in range(6)], [2.0 + i for i in range(6)]
    raw = {
        **PHI3,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long},
    }
    config = _config(tmp_path, raw)
    assert config.rotary_dim == 12
    base = _inv_freq(10_000.0, 12)
    within, scaling = rope_parameters(config, None, max_model_len=64)
    past, _ = rope_parameters(config, None, max_model_len=65)
    assert torch.allclose(within, base / torch.tensor(short))
    assert torch.allclose(past, base / torch.tensor(long))
    assert scaling == pytest.approx(math.sqrt(1 + math.log(512 / 64) / math.log(64)))


def test_a_multimodal_gemma3_reads_its_text_config(tmp_path: pathlib.Path) -> None:
    text = {k: v for k, v in GEMMA3_TEXT.items() if k not in ("architectures", "eos_token_id")}
    raw = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "num_hidden_layers": 1},
        "eos_token_id": [1, 106],
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    config = _config(tmp_path, raw)
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert (config.hidden_size, config.num_layers, config.head_dim, config.num_kv_heads) == (64, 4, 32, 1)
    assert config.sliding_windows == (16, None, 16, None)
    assert config.eos_token_ids == (1, 106) and config.tie_word_embeddings
    assert config.torch_dtype == "bfloat16" and config.gemma is not None


def test_multimodal_tensor_names_map_to_the_text_model() -> None:
    arch = "Gemma3ForConditionalGeneration"
    assert (
        engine_name("language_model.model.layers.0.mlp.up_proj.weight", arch)
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert engine_name("model.language_model.norm.weight", arch) == "model.norm.weight"
    assert engine_name("language_model.lm_head.weight", arch) == "lm_head.weight"
    assert engine_name("lm_head.weight", arch) == "lm_head.weight"
    for vision in (
        "vision_tower.vision_model.embeddings.patch_embedding.weight",
        "model.vision_tower.post_layernorm.bias",
        "multi_modal_projector.mm_input_projection_weight",
        "model.multi_modal_projector.mm_soft_emb_norm.weight",
    ):
        assert engine_name(vision, arch) is None
    # Other architectures' names are their own (a stray prefix is then an unexpected tensor).
    assert (
        engine_name("language_model.model.norm.weight", "Gemma3ForCausalLM")
        == "language_model.model.norm.weight"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "Gemma 2's"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ],
)
def test_what_gemma3_does_not_have_is_refused(tmp_path: pathlib.Path, change: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        _config(tmp_path, {**GEMMA3_TEXT, **change})


def test_a_partial_rotary_that_leaves_an_odd_count_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0\.2 leaves 3 of 16"):
        _config(tmp_path, {**PHI3, "partial_rotary_factor": 0.2})  # rotation pairs dims: 3 cannot be


def test_gemma2_windows_alternate_and_its_caps_are_read(tmp_path: pathlib.Path) -> None:
    """gemma-2-2b's config.json form (no layer_types: transformers alternates sliding and global
    layers); its soft-caps, query_pre_attn_scalar and Gemma's norms, with one rope base."""
    raw = {
        **{k: v for k, v in GEMMA3_TEXT.items() if not k.startswith(("sliding_window_", "rope_local"))},
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    config = _config(tmp_path, raw)
    assert config.sliding_windows == (16, None, 16, None) and config.rope_kinds == ()
    assert config.family is not None and config.gemma is not None and not config.qk_norm
    assert (config.family.attn_logit_softcapping, config.family.final_logit_softcapping) == (50.0, 30.0)
    assert config.attention_scale == 24**-0.5 and config.hidden_act == "gelu_pytorch_tanh"
    uncapped = _config(tmp_path, {**raw, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert uncapped.family is not None and uncapped.family.attn_logit_softcapping is None


def test_granite_multipliers_are_read_and_checked(tmp_path: pathlib.Path) -> None:
    raw = {
        **{k: v for k, v in PHI3.items() if k != "sliding_window"},
        "model_type": "granite",
        "architectures": ["GraniteForCausalLM"],
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125,
        "logits_scaling": 16.0,
    }
    config = _config(tmp_path, raw)
    assert config.attention_scale == 0.0078125 and config.gemma is None
    assert config.family is not None
    family = config.family
    assert (family.embedding_multiplier, family.residual_multiplier, family.logits_scaling) == (
        12.0,
        0.22,
        16.0,
    )
    with pytest.raises(ModelLoadError, match="logits_scaling must be a positive number, got 0"):
        _config(tmp_path, {**raw, "logits_scaling": 0})


def test_olmo2_norms_q_and_k_over_the_whole_projection(tmp_path: pathlib.Path) -> None:
    raw = {**PHI3, "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "sliding_window": None}
    config = _config(tmp_path, raw)
    assert config.qk_norm and config.family is not None and config.family.is_post_norm
    assert config.sliding_windows == (None, None) and config.attention_scale is None
