"""The surface of AsyncEngine the server uses; tests satisfy it with a fake engine.

An engine may also offer `listen(request_id, listener) -> bool` (`StreamFront.listen`: the
request's outputs handed to a callback as they arrive, instead of read from its stream); the
server streams through it where it is there (`GenerationRun.listen`); and
`end_open_streams(error)` (`StreamFront.end_open_streams`), which a drain calls when its grace
period ends, so open streams close with an error event and `[DONE]` rather than being cut.
The model's own engines and simulated replicas also say which runner serves it (`EmbeddingEngine`:
generate, or pooling with its vectors' size); one that does not (a test's fake) generates
(`runner_of`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Protocol

from corral_engine.outputs import EngineStats, RequestOutput
from corral_engine.pooling import EmbedSpec, Runner
from corral_engine.pooling_params import PoolingParams
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
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, in_group: bool = False
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...


class EmbeddingEngine(Protocol):
    """An engine that says its runner; a pooling one takes PoolingParams (embeddings)."""

    runner: Literal["generate", "pooling"]
    embedding_size: int  # the vectors' length; 0 for a generate engine

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        *,
        in_group: bool = False,
    ) -> AsyncIterator[RequestOutput]: ...


def runner_of(engine: object) -> str:
    """The engine's runner: "pooling" for an embedding model, else "generate"."""
    return str(getattr(engine, "runner", "generate"))


def num_labels_of(engine: object) -> int:
    """A cross-encoder's classifier outputs (its `embed` spec's); 0 for any other engine."""
    return int(getattr(getattr(engine, "embed", None), "num_labels", 0))


def labels_of(engine: object) -> tuple[str | None, ...]:
    """A classifier's output names (its `embed` spec's id2label); empty for any other engine."""
    return tuple(getattr(getattr(engine, "embed", None), "labels", ()))


def embed_spec_of(engine: object, model_name: str) -> EmbedSpec:
    """What the engine serves (its `embed` spec: runner, tasks, labels); for an engine without
    one (a test's fake), a spec of its runner and vector size."""
    spec = getattr(engine, "embed", None)
    if isinstance(spec, EmbedSpec):
        return spec
    runner: Runner = "pooling" if runner_of(engine) == "pooling" else "generate"
    return EmbedSpec(model_name, runner, int(getattr(engine, "embedding_size", 0)))


def problem_type_of(engine: object) -> str | None:
    """A classifier's problem type (config.json's; how /classify activates its outputs), or None."""
    return getattr(getattr(engine, "embed", None), "problem_type", None)


class ListeningEngine(Protocol):
    def listen(self, request_id: str, listener: Callable[[RequestOutput | BaseException], None]) -> bool: ...
