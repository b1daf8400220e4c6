"""The surface of AsyncEngine the server uses; tests satisfy it with a fake engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from corral_engine.outputs import EngineStats, RequestOutput
from corral_engine.sampling_params import SamplingParams


class EngineClient(Protocol):
    tokenizer: Any  # a transformers PreTrainedTokenizerBase: encode, decode, apply_chat_template
    served_model_name: str
    max_model_len: int

    @property
    def is_running(self) -> bool: ...  # False once the step loop died or shut down

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...
