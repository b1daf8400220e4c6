"""Requests built from prompts: tokenized, checked (request_checks.py), given engine-unique
sequence ids and an arrival order, and their grammars attached; safe from any thread (no torch)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceABC
from typing import Any, Protocol

from corral_engine.core.sequence import Request, Sequence
from corral_engine.lora import LoraRequest
from corral_engine.multimodal import (
    ImageInput,
    ImagePrompts,
    MultiModalPrompt,
    check_images,
    prompt_of,
    with_images,
)
from corral_engine.outputs import RequestMetrics
from corral_engine.pooling import EmbedSpec
from corral_engine.pooling_params import PoolingParams
from corral_engine.request_checks import KvCapacity, check_pooling_prompt, check_request
from corral_engine.sampling_params import SamplingParams

Prompt = str | list[int] | MultiModalPrompt
# What the scheduler admits a pooling request by: its prompt, and no output token to sample.
POOLING_SAMPLING = SamplingParams(max_tokens=1, output_kind="final_only")


def paired(
    prompts: str | SequenceABC[Prompt],
    params: SamplingParams | PoolingParams | SequenceABC[SamplingParams | PoolingParams],
) -> tuple[list[Prompt], list[SamplingParams | PoolingParams]]:
    """A batch's prompts, each with its params: a string is one prompt, as in vLLM (not one per
    character), and one params object serves every prompt (ValueError where the counts differ)."""
    prompt_list: list[Prompt] = [prompts] if isinstance(prompts, str) else list(prompts)
    param_list: list[SamplingParams | PoolingParams]
    if isinstance(params, SamplingParams | PoolingParams):
        param_list = [params] * len(prompt_list)
    else:
        param_list = list(params)
    if len(param_list) != len(prompt_list):
        raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} SamplingParams")
    return prompt_list, param_list


class GrammarAttacher(Protocol):
    """What the builder needs of the grammar compiler: a request's grammars compiled and set."""

    def attach(self, request: Request) -> None: ...


class RequestBuilder:
    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        kv: KvCapacity,
        grammars: GrammarAttacher,
        embed: EmbedSpec | None = None,
        images: ImagePrompts | None = None,
    ) -> None:
        """`embed`: the served model's runner and embedding shape (None: a generate engine);
        `images`: a vision-language model's image processor (None: images are refused)."""
        self.tokenizer = tokenizer
        self.images = images
        self.embed = embed or EmbedSpec("the model")
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv = kv
        self.grammars = grammars
        # itertools.count's next() is atomic under the GIL: any thread may build requests.
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    def tokenize(self, prompt: Prompt) -> list[int]:
        text_or_ids = prompt_of(prompt)
        if isinstance(text_or_ids, str):
            return list(self.tokenizer.encode(text_or_ids, add_special_tokens=True))
        return list(text_or_ids)

    def with_images(
        self, prompt: Prompt, mm_inputs: tuple[ImageInput, ...] | None = None
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids (placeholders expanded) and its images: processed here from a
        prompt's `multi_modal_data`, or as given (`mm_inputs`: already processed, by the server's
        side of the engine core)."""
        token_ids = self.tokenize(prompt)
        if mm_inputs is None:
            return with_images(prompt, token_ids, self.images, self.embed.model_name)
        check_images(token_ids, mm_inputs, self.images, self.embed.model_name)
        return token_ids, mm_inputs

    def next_arrival(self) -> int:
        """The next arrival number (also what `LLMEngine.generate` names its requests with)."""
        return next(self._arrivals)

    def build(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora: LoraRequest | None = None,
        mm_inputs: tuple[ImageInput, ...] | None = None,
    ) -> Request:
        """A checked request of `params.n` sequences (one for pooling); InvalidRequestError when
        it is refused. `mm_inputs`: its images already processed (see `with_images`)."""
        self.embed.check(params)  # the right kind for this runner
        token_ids, images = self.with_images(prompt, mm_inputs)
        pooling = params if isinstance(params, PoolingParams) else None
        if isinstance(params, PoolingParams):
            check_pooling_prompt(token_ids, self.max_model_len, self.vocab_size, self.kv)
            params = POOLING_SAMPLING
        else:
            params = check_request(token_ids, params, self.max_model_len, self.vocab_size, self.kv)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_order=self.next_arrival(),
            metrics=RequestMetrics.for_sequences(
                time.monotonic() if arrival_time is None else arrival_time, params.n
            ),
            lora=lora,
            pooling=pooling,
            mm_inputs=images,
        )
        request.seqs = [
            Sequence(next(self._seq_ids), request, i, list(token_ids), len(token_ids))
            for i in range(params.n)
        ]
        self.grammars.attach(request)
        return request
