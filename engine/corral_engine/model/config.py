"""What the engine needs from a checkpoint's config.json, checked once at load time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError
from corral_engine.model.encoder_config import SUPPORTED_ENCODERS, EncoderConfig, load_encoder_config
from corral_engine.model.family_math import (
    FAMILY_ARCHITECTURES,
    GEMMA2,
    GRANITE,
    OLMO2,
    FamilyMath,
    family_math,
)
from corral_engine.model.hf_config import auto_config
from corral_engine.pooling import (
    causal_implementation,
    is_embedding_architecture,
    is_encoder_architecture,
    matryoshka_of,
)
from corral_engine.vision_config import (
    REFUSED_VISION_ARCHITECTURES,
    VISION_ARCHITECTURES,
    VisionConfig,
    load_vision_config,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    *FAMILY_ARCHITECTURES,
    *VISION_ARCHITECTURES,
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Whose config-wide `sliding_window` applies to every layer (None: full attention); others name
# their sliding layers in `layer_types` (Gemma 3, Qwen2 with max_window_layers).
_WINDOW_EVERYWHERE = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's, as transformers' ACT2FN names them


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: Path
    architecture: str
    # transformers.PretrainedConfig of the decoder (a multimodal checkpoint's text_config); used
    # for rope parameters
    hf_config: Any
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]  # per layer
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (model/moe.py); none of it for dense models.
    moe: MoeConfig | None = None
    # config.json's quantization_config as written (model/quant.py reads it), or None.
    quantization_config: dict[str, Any] | None = None
    hidden_act: str = "silu"  # the MLP gate's activation (ACTIVATIONS)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    rotary_dim: int | None = None  # leading dims of a head that rotate (partial rotary); None: all
    # Per layer: which entry of hf_config.rope_parameters sets its rotary (Gemma 3's
    # "sliding_attention" / "full_attention"); empty: one set of parameters for every layer.
    rope_kinds: tuple[str, ...] = ()
    gemma: GemmaMath | None = None  # Gemma 2 and 3's departures from the Llama math; None for the others
    family: FamilyMath | None = None  # Granite's, OLMo 2's and Gemma 2's others (model/family_math.py)
    # config.json's `architectures` as written: an embedding checkpoint names a base-model class
    # (`Qwen2Model`), which `architecture` maps to the implementation that runs it.
    declared_architectures: tuple[str, ...] = ()
    is_matryoshka: bool = False  # config.json's is_matryoshka, or matryoshka_dimensions given
    matryoshka_dimensions: tuple[int, ...] | None = None
    # An encoder-only embedding model (BERT, RoBERTa, XLM-RoBERTa: model/encoder.py), whose own
    # config this is; the decoder fields above then only describe its shape.
    encoder: EncoderConfig | None = None
    # A vision-language model's (LLaVA) vision tower, projector and image token; None: text only.
    vision: VisionConfig | None = None

    @property
    def num_labels(self) -> int:
        """A cross-encoder's classifier outputs (config.json's id2label); 0 for any other model."""
        return 0 if self.encoder is None else self.encoder.num_labels

    @property
    def is_base_model(self) -> bool:
        """Whether the checkpoint is a base model without an LM head (`Qwen2Model`): embeddings only."""
        return any(is_embedding_architecture(a) for a in self.declared_architectures)

    @property
    def rope_kind_set(self) -> tuple[str | None, ...]:
        """The distinct rope parameter sets, in first-use order (None: the config's only one)."""
        return tuple(dict.fromkeys(self.rope_kinds)) if self.rope_kinds else (None,)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` routes through experts (else a dense MLP)."""
        return self.moe is not None and self.moe.sparse_layers[layer_idx]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class GemmaMath:
    """Gemma 2 and 3 (transformers' modeling_gemma3): every RMSNorm scales by (1 + weight) in float32;
    the attention output and the MLP output are normed before their residual add (four norms a
    layer); the embeddings are multiplied by sqrt(hidden_size) in the model dtype."""

    embed_scale: float


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int  # top-k
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    # Mixtral scales each expert's output by its float32 weight; Qwen3-MoE rounds the weights to the
    # model dtype first (transformers' order in each, so bf16 outputs round alike).
    is_weight_fp32: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (False)


def _positive_int(hf: Any, names: tuple[str, ...], what: str, where: Path) -> int:
    value = next((getattr(hf, n) for n in names if getattr(hf, n, None) is not None), None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(
            f"{where}: {what} ({' or '.join(names)}) must be a positive integer, got {value!r}"
        )
    return value


def _moe_config(arch: str, hf: Any, num_layers: int, where: Path) -> MoeConfig:
    """The experts' shape and routing, checked: a bad value is a ModelLoadError naming it."""
    num_experts = _positive_int(hf, ("num_local_experts", "num_experts"), "the number of experts", where)
    top_k = _positive_int(hf, ("num_experts_per_tok",), "the experts per token", where)
    if top_k > num_experts:
        raise ModelLoadError(
            f"{where}: num_experts_per_tok {top_k} is more than the {num_experts} experts there are"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {hf.hidden_act!r} is not supported (only silu)")
    if arch == "MixtralForCausalLM":
        size = _positive_int(hf, ("intermediate_size",), "the experts' intermediate size", where)
        return MoeConfig(num_experts, top_k, size, True, True, (True,) * num_layers)
    size = _positive_int(hf, ("moe_intermediate_size",), "the experts' intermediate size", where)
    step = _positive_int(hf, ("decoder_sparse_step",), "decoder_sparse_step", where)
    dense = getattr(hf, "mlp_only_layers", None) or []  # a list of ints: transformers checks its type
    norm = bool(getattr(hf, "norm_topk_prob", False))
    return MoeConfig(num_experts, top_k, size, norm, False, sparse_layers(num_layers, step, dense))


def sparse_layers(num_layers: int, decoder_sparse_step: int, mlp_only_layers: list[int]) -> tuple[bool, ...]:
    """Qwen3-MoE's layers with experts, by transformers' rule: each unless listed as MLP-only or
    off the sparse step."""
    return tuple(i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 for i in range(num_layers))


def _eos_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{gen}: cannot be read as JSON: {e}") from e
    for src in sources:
        for tok in src if isinstance(src, list) else [src]:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return tuple(ids)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir)
    if path.is_file():
        raise ModelLoadError(
            f"model path {str(path)!r} is a file, not a checkpoint directory "
            "(give the directory that holds config.json)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
    archs = raw.get("architectures") or []
    refused = next((a for a in archs if a in REFUSED_VISION_ARCHITECTURES), None)
    if refused is not None:
        raise ModelLoadError(
            f"{config_file}: {refused} is not supported yet ({REFUSED_VISION_ARCHITECTURES[refused]}); "
            "vision-language models: LlavaForConditionalGeneration (LLaVA-1.5, one image tile), "
            "Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration"
        )
    if any(isinstance(a, str) and is_encoder_architecture(a) for a in archs):
        return _encoder_model_config(path, raw)
    arch = next(
        (causal_implementation(a) for a in archs if causal_implementation(a) in SUPPORTED_ARCHITECTURES), None
    )
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}; embedding encoders: "
            f"{', '.join(SUPPORTED_ENCODERS)}"
        )
    hf = auto_config(path)
    top = hf  # a multimodal checkpoint's own config: its eos ids and tying are the model's
    if arch == "Gemma3ForConditionalGeneration":
        hf = hf.text_config  # the text model alone is served; the vision tower is not loaded
    vision = load_vision_config(hf, config_file) if arch in VISION_ARCHITECTURES else None
    if vision is not None:
        hf = hf.text_config
    family = arch if vision is None else vision.text_architecture  # what the text layers compute
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    num_layers = hf.num_hidden_layers
    layer_types = list(getattr(hf, "layer_types", None) or [])
    window = getattr(hf, "sliding_window", None)
    windows: list[int | None] = []
    for i in range(num_layers):
        is_sliding = layer_types[i] == "sliding_attention" if layer_types else family in _WINDOW_EVERYWHERE
        windows.append(window if is_sliding and window else None)
    quantization = raw.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise ModelLoadError(f"{config_file}: quantization_config must be an object, got {quantization!r}")
    is_qwen2 = family == "Qwen2ForCausalLM"
    is_gemma = arch in GEMMA3_ARCHITECTURES
    has_gemma_math = is_gemma or arch == GEMMA2
    attention_bias = bool(getattr(hf, "attention_bias", False))
    hidden_act = _activation(hf, config_file)
    is_matryoshka, matryoshka_dimensions = matryoshka_of(raw)
    if is_gemma:
        _check_gemma(hf, config_file)
    return ModelConfig(
        path=path,
        architecture=arch,
        hf_config=hf,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", OLMO2) or is_gemma,
        tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
        max_position_embeddings=hf.max_position_embeddings,
        sliding_windows=tuple(windows),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "") or None,
        eos_token_ids=_eos_ids(path, top),
        moe=_moe_config(arch, hf, num_layers, config_file) if arch in MOE_ARCHITECTURES else None,
        quantization_config=quantization,
        hidden_act=hidden_act,
        attention_scale=_attention_scale(arch, hf, has_gemma_math),
        rotary_dim=_rotary_dim(hf, head_dim, config_file),
        rope_kinds=tuple(layer_types) if is_gemma else (),
        gemma=GemmaMath(embed_scale=hf.hidden_size**0.5) if has_gemma_math else None,
        family=family_math(arch, hf, config_file),
        declared_architectures=tuple(str(a) for a in archs),
        is_matryoshka=is_matryoshka,
        matryoshka_dimensions=matryoshka_dimensions,
        vision=vision,
    )


def _encoder_model_config(path: Path, raw: dict[str, Any]) -> ModelConfig:
    """An encoder checkpoint: its EncoderConfig, with the shape fields the engine reads of any model
    (its context is what the position table covers; no end-of-sequence ids: it never generates)."""
    enc = load_encoder_config(path, raw)  # config.json read once, here
    is_matryoshka, matryoshka_dimensions = matryoshka_of(raw)
    return ModelConfig(
        path=path,
        architecture=enc.architecture,
        hf_config=None,
        vocab_size=enc.vocab_size,
        hidden_size=enc.hidden_size,
        intermediate_size=enc.intermediate_size,
        num_layers=enc.num_layers,
        num_heads=enc.num_heads,
        num_kv_heads=enc.num_heads,
        head_dim=enc.head_dim,
        rms_norm_eps=enc.layer_norm_eps,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        qk_norm=False,
        tie_word_embeddings=False,
        max_position_embeddings=enc.max_model_len,
        sliding_windows=(None,) * enc.num_layers,
        torch_dtype=enc.torch_dtype,
        eos_token_ids=(),
        hidden_act=enc.hidden_act,
        declared_architectures=tuple(str(a) for a in raw.get("architectures") or []),
        is_matryoshka=is_matryoshka,
        matryoshka_dimensions=matryoshka_dimensions,
        encoder=enc,
    )


def _activation(hf: Any, where: Path) -> str:
    """The MLP gate's activation (Gemma names it hidden_activation), one this engine computes."""
    field = "hidden_activation" if getattr(hf, "hidden_activation", None) else "hidden_act"
    act = getattr(hf, field, None) or "silu"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{where}: {field} {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    return str(act)


def _attention_scale(arch: str, hf: Any, has_gemma_math: bool) -> float | None:
    """The softmax scale where it is not head_dim ** -0.5: Gemma's query_pre_attn_scalar ** -0.5,
    Granite's attention_multiplier."""
    if has_gemma_math:
        return float(hf.query_pre_attn_scalar) ** -0.5
    return float(hf.attention_multiplier) if arch == GRANITE else None


def _check_gemma(hf: Any, where: Path) -> None:
    """Refuse what Gemma 3 checkpoints never set but a Gemma-2-style or embedding config would."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf, field, None) is not None:
            raise ModelLoadError(
                f"{where}: {field} {getattr(hf, field)!r} is not supported: logit softcapping is "
                "Gemma 2's (Gemma2ForCausalLM); Gemma 3 checkpoints set it to null"
            )
    if getattr(hf, "use_bidirectional_attention", False):
        raise ModelLoadError(
            f"{where}: use_bidirectional_attention is set (EmbeddingGemma): the engine's decoder "
            "attends causally only, for generation and for --runner pooling alike"
        )


def _rotary_dim(hf: Any, head_dim: int, where: Path) -> int | None:
    """The rotating share of a head (Phi-4-mini's partial_rotary_factor 0.75), or None for all of it."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if factor is None or factor == 1.0:
        return None
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ModelLoadError(
            f"{where}: partial_rotary_factor {factor!r} leaves {dim} of {head_dim} head dims rotating; "
            "it must be an even count of at least 2"
        )
    return dim
