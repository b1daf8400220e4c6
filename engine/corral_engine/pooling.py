"""Embedding (pooling) models, the pure part: which runner serves a checkpoint, how its hidden
states are pooled (--pooler-config, the checkpoint's sentence-transformers files, vLLM's embed
default), matryoshka dimensions, and the checks on a pooling request (light; no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.options import ArgumentError
from corral_engine.pooling_params import ClassifierActivation, PoolingParams, PoolingTask
from corral_engine.sampling_params import SamplingParams

Runner = Literal["generate", "pooling"]
PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")
# The --pooler-config keys Corral takes (vLLM's names); vLLM has more (softmax, activation, ...)
# for tasks Corral does not serve.
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")
# vLLM's --runner auto: a checkpoint naming one of these is an embedding model.
_EMBEDDING_SUFFIXES = ("ForTextEncoding", "EmbeddingModel", "Model")
# The BERT-family encoders served (model/encoder.py), each with whether its positions start past
# the padding index (RoBERTa's numbering). Here, not in corral_engine.model, so the simulator reads it.
ENCODER_ARCHITECTURES = {
    "BertModel": False,
    "BertForMaskedLM": False,  # its MLM head (cls.*) is not loaded
    "RobertaModel": True,
    "XLMRobertaModel": True,
    # Cross-encoders (rerankers): the encoder, then a classification head on the first token.
    "BertForSequenceClassification": False,
    "RobertaForSequenceClassification": True,
    "XLMRobertaForSequenceClassification": True,
    # Token classifiers (NER and kin): the encoder, then a linear head on every token.
    "BertForTokenClassification": False,
    "RobertaForTokenClassification": True,
    "XLMRobertaForTokenClassification": True,
}


def is_encoder_architecture(arch: str) -> bool:
    """Whether `arch` (config.json's architectures[0]) is an encoder this engine can load."""
    return arch in ENCODER_ARCHITECTURES


def is_classifier_architecture(arch: str) -> bool:
    """Whether `arch` carries a classification head, of a sequence or of each token (served for
    scores or labels, not embeddings)."""
    return arch.endswith(("ForSequenceClassification", "ForTokenClassification"))


def is_token_classifier_architecture(arch: str) -> bool:
    """Whether `arch`'s head labels each token (vLLM's token_classify task), not the sequence."""
    return arch.endswith("ForTokenClassification")


# Base-model classes not named <family>Model -> the implementation that runs them.
_BASE_MODEL_IMPLEMENTATIONS = {"Gemma3TextModel": "Gemma3ForCausalLM"}
# sentence-transformers' Pooling config keys -> the pooling they ask for.
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a sequence's hidden states become its vector: which rows, and whether it is scaled to
    unit length by default (a request's `normalize` may say otherwise)."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True


def is_embedding_architecture(architecture: str) -> bool:
    """vLLM's rule for --runner auto: *Model, *EmbeddingModel and *ForTextEncoding embed."""
    return architecture.endswith(_EMBEDDING_SUFFIXES)


def causal_implementation(architecture: str) -> str:
    """The *ForCausalLM implementation that runs a base-model class (`Qwen2Model` ->
    `Qwen2ForCausalLM`); any other name as it is."""
    if architecture in _BASE_MODEL_IMPLEMENTATIONS:
        return _BASE_MODEL_IMPLEMENTATIONS[architecture]
    for suffix in _EMBEDDING_SUFFIXES:
        if architecture.endswith(suffix):
            return architecture.removesuffix(suffix) + "ForCausalLM"
    return architecture


def choose_runner(requested: str, architectures: list[str]) -> Runner:
    """--runner: generate or pooling as asked; auto picks pooling for an embedding architecture or
    an encoder (BertForMaskedLM and the rerankers too: an encoder never generates here)."""
    if requested in ("generate", "pooling"):
        return cast(Runner, requested)
    pools = any(is_embedding_architecture(a) or is_encoder_architecture(a) for a in architectures)
    return "pooling" if pools else "generate"


def parse_pooler_config(text: str) -> dict[str, Any]:
    """--pooler-config's JSON object, checked (ArgumentError naming what is wrong)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ArgumentError(f"pooler_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ArgumentError(f"pooler_config must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - set(POOLER_CONFIG_KEYS))
    if unknown:
        raise ArgumentError(
            f"pooler_config: unknown or unsupported key(s) {', '.join(unknown)} "
            f"(Corral takes {', '.join(POOLER_CONFIG_KEYS)})"
        )
    out: dict[str, Any] = {}
    kind = value.get("pooling_type")
    if kind is not None:
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ArgumentError(
                f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}"
            )
        out["pooling_type"] = kind.upper()
    normalize = value.get("normalize")
    if normalize is not None:
        if not isinstance(normalize, bool):
            raise ArgumentError(f"pooler_config: normalize must be true or false, got {normalize!r}")
        out["normalize"] = normalize
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot be read as JSON: {e}") from None


def sentence_transformers_pooling(model_dir: Path, needs_type: bool = True) -> dict[str, Any]:
    """The pooling a checkpoint's sentence-transformers files ask for, as vLLM reads them:
    modules.json's Pooling module's config.json (last token, mean or CLS) and whether a Normalize
    module follows. Empty without modules.json; ModelLoadError for a pooling Corral cannot do,
    unless `needs_type` is False (--pooler-config chose one)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file}: must be a list of modules")
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    out: dict[str, Any] = {"normalize": _ST_NORMALIZE in types}
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return out
    config_file = model_dir / str(pooling.get("path", "")) / "config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    for mode in modes:
        if mode not in _ST_MODES and needs_type:
            raise ModelLoadError(
                f"{config_file}: {mode} is not supported (Corral pools by last token, mean or CLS; "
                "give --pooler-config to choose one)"
            )
    known = [mode for mode in modes if mode in _ST_MODES]
    if known:
        out["pooling_type"] = _ST_MODES[known[0]]
    return out


def resolve_pooler(
    model_dir: Path, pooler_config: str | None, default_type: PoolingType = "LAST"
) -> PoolerConfig:
    """Each setting from --pooler-config, else the sentence-transformers files, else vLLM's embed
    default (`default_type`: the last token for a decoder, the first for an encoder; normalized)."""
    given = parse_pooler_config(pooler_config) if pooler_config else {}
    merged = {**sentence_transformers_pooling(model_dir, "pooling_type" not in given), **given}
    return PoolerConfig(
        pooling_type=merged.get("pooling_type", default_type), normalize=merged.get("normalize", True)
    )


def classify_activation(problem_type: str | None, use_activation: bool = True) -> ClassifierActivation:
    """How /classify activates a classifier's logits, as vLLM does after transformers' loss for
    each problem type: none for regression, each label's sigmoid for multi-label, else "auto"
    (softmax over labels; one label's sigmoid). `use_activation` False: the raw logits."""
    if not use_activation or problem_type == "regression":
        return "none"
    return "sigmoid" if problem_type == "multi_label_classification" else "auto"


@dataclass(frozen=True, slots=True)
class EmbedSpec:
    """What a request's checks and responses need of the served model: its runner and, for
    pooling, the vector size and matryoshka dimensions (config.json's `is_matryoshka` /
    `matryoshka_dimensions`), or a classifier's labels and problem type."""

    model_name: str
    runner: Runner = "generate"
    embedding_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_labels: int = 0  # a cross-encoder's classifier outputs; 0: not a classifier
    labels: tuple[str | None, ...] = ()  # each output's name (config.json's id2label)
    problem_type: str | None = None  # config.json's (how /classify activates the outputs)
    is_token_classifier: bool = False  # its head labels each token (*ForTokenClassification)
    is_encoder: bool = False  # BERT and kin: prompts run whole, so per-token outputs are computed

    @property
    def tasks(self) -> tuple[PoolingTask, ...]:
        """The pooling tasks served, the default first (vLLM's /pooling without a task); none
        when generating. Per-token embeddings need every prompt row: encoders only (a decoder's
        chunks and cached prefixes skip rows)."""
        if self.runner != "pooling":
            return ()
        if self.is_token_classifier:
            return ("token_classify",)
        if self.num_labels:
            return ("classify",)
        return ("embed", "token_embed") if self.is_encoder else ("embed",)

    @property
    def task(self) -> PoolingTask | None:
        """What a pooling engine's requests ask for by default (None: a generating engine)."""
        return self.tasks[0] if self.tasks else None

    def refusal(self, task: str) -> str:
        """Why a pooling engine does not serve `task`, in words."""
        served = ", ".join(self.tasks)
        if task == "token_embed" and not self.num_labels:
            return (
                f"{self.model_name} is {self.describe()}, not an encoder: token_embed (one vector a "
                "token) is computed for encoder models (BERT, RoBERTa, XLM-RoBERTa) only"
            )
        if task == "token_classify" and not self.is_token_classifier:
            return (
                f"{self.model_name} is {self.describe()}: token_classify needs a token "
                f"classification model (*ForTokenClassification); it serves {served}"
            )
        what = f"{self.model_name} is {self.describe()}"
        return f"{what}: it does not serve {task} requests (it serves {served})"

    def check(self, params: SamplingParams | PoolingParams) -> None:
        """InvalidRequestError for params of the other runner or task, or dimensions the model refuses."""
        if isinstance(params, PoolingParams) != (self.runner == "pooling"):
            if self.runner == "pooling":
                raise InvalidRequestError(
                    f"{self.model_name} is served with --runner pooling ({self.describe()}): it does "
                    f"not generate text; use {self.routes()}"
                )
            raise InvalidRequestError(
                f"{self.model_name} is served with --runner generate: it does not compute embeddings "
                "or scores"
            )
        if not isinstance(params, PoolingParams):
            return
        if params.task not in self.tasks:
            raise InvalidRequestError(f"{self.refusal(params.task)}; use {self.routes()}")
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions)

    def describe(self) -> str:
        """What a pooling engine serves, in words."""
        if self.is_token_classifier:
            return f"a token classification model ({self.num_labels} labels)"
        if self.num_labels == 1:
            return "a classification model (a cross-encoder)"
        if self.num_labels:
            return f"a classification model ({self.num_labels} labels)"
        return "an embedding model"

    def routes(self) -> str:
        """The routes that serve this pooling engine's task."""
        if self.num_labels:
            return classifier_routes(self.num_labels, self.is_token_classifier)
        return "/v1/embeddings or /pooling"

    def _check_dimensions(self, dimensions: int) -> None:
        if not self.is_matryoshka:
            raise InvalidRequestError(
                f"Model {self.model_name} does not support matryoshka representation: changing its "
                "output dimensions would give poor results.",
                "dimensions",
            )
        if dimensions < 1:
            raise InvalidRequestError("dimensions must be greater than 0.", "dimensions")
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise InvalidRequestError(
                f"Model {self.model_name} only supports matryoshka dimensions {list(allowed)}.",
                "dimensions",
            )
        if dimensions > self.embedding_size:
            raise InvalidRequestError(
                f"dimensions {dimensions} is more than the model's {self.embedding_size}.", "dimensions"
            )


def classifier_routes(num_labels: int, is_token_classifier: bool = False) -> str:
    """The routes that serve a classifier of `num_labels` outputs: scores need one; a token
    classifier's labels (one set a token) come from /pooling only."""
    if is_token_classifier:
        return "/pooling (task token_classify)"
    return "/v1/score or /v1/rerank (scores), /classify (labels)" if num_labels == 1 else "/classify"


def matryoshka_of(raw_config: dict[str, Any]) -> tuple[bool, tuple[int, ...] | None]:
    """(whether the model is matryoshka, the dimensions it names or None), as vLLM reads config.json."""
    dims = raw_config.get("matryoshka_dimensions")
    is_matryoshka = bool(raw_config.get("is_matryoshka")) or dims is not None
    if dims is None:
        return is_matryoshka, None
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ModelLoadError(f"matryoshka_dimensions must be a list of integers, got {dims!r}")
    return is_matryoshka, tuple(dims)
