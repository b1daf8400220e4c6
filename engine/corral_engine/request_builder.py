"""Requests built from prompts: tokenized, checked (request_checks.py), given engine-unique
sequence ids and an arrival order, and their grammars attached; safe from any thread (no torch)."""

from __future__ import annotations

import itertools
import time
from typing import Any, Protocol

from corral_engine.core.sequence import Request, Sequence
from corral_engine.lora import LoraRequest
from corral_engine.outputs import RequestMetrics
from corral_engine.pooling import EmbedSpec
from corral_engine.pooling_params import PoolingParams
from corral_engine.request_checks import KvCapacity, check_pooling_prompt, check_request
from corral_engine.sampling_params import SamplingParams

Prompt = str | list[int]
# What the scheduler admits a pooling request by: its prompt, and no output token to sample.
POOLING_SAMPLING = SamplingParams(max_tokens=1, output_kind="final_only")


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
    ) -> None:
        """`embed`: the served model's runner and embedding shape (None: a generate engine)."""
        self.tokenizer = tokenizer
        self.embed = embed or EmbedSpec("the model")
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv = kv
        self.grammars = grammars
        # itertools.count's next() is atomic under the GIL: any thread may build requests.
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

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
    ) -> Request:
        """A checked request of `params.n` sequences (one for pooling); InvalidRequestError when
        it is refused."""
        self.embed.check(params)  # the right kind for this runner
        token_ids = self.tokenize(prompt)
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
        )
        request.seqs = [
            Sequence(next(self._seq_ids), request, i, list(token_ids), len(token_ids))
            for i in range(params.n)
        ]
        self.grammars.attach(request)
        return request
