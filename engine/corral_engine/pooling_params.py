"""A pooling request's parameters (an embedding, a cross-encoder's score, or vLLM's per-token
outputs): what `add_request` takes in place of SamplingParams on an engine served with --runner
pooling, as vLLM v1 does (light; no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# vLLM's pooling tasks: one output a sequence (embed, classify) or one a prompt token (token_embed,
# token_classify). A per-token output comes back flat: its rows, one a prompt token, concatenated.
PoolingTask = Literal["embed", "classify", "token_embed", "token_classify"]
TOKEN_TASKS: tuple[PoolingTask, ...] = ("token_embed", "token_classify")
# A classifier's outputs: "auto" the sigmoid of one label's logit, else softmax over the labels
# (vLLM's default); "sigmoid" each label's own (multi-label models); "none" the raw logits.
ClassifierActivation = Literal["auto", "sigmoid", "none"]


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """`task`: "embed" (a vector), "classify" (a classifier model's outputs, activated as
    `activation` says), or their per-token forms (each prompt token's, normalized or activated
    alike). `dimensions`: keep the vector's first N values,
    then normalize again (matryoshka models only); `normalize`: scale to unit length (None: the
    model's pooler config decides). `second_segment_start`: a sentence pair's token types,
    compressed as vLLM does: type 1 from this prompt position on, 0 before (None: all 0)."""

    task: PoolingTask = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    second_segment_start: int | None = None
    activation: ClassifierActivation = "auto"
