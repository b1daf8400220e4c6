"""A fake AsyncEngine for server unit tests: byte tokenizer, scripted tokens, real abort/queue semantics."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from corral_engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from corral_engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    StepLatencies,
    TokenLogprob,
)
from corral_engine.sampling_params import SamplingParams

BOS = 256
VOCAB = 258


class FakeTokenizer:
    """Bytes are tokens; 256 is BOS. The chat template refuses `tool` messages."""

    chat_template = "<role>content, per message"  # has one: apply_chat_template renders it

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True
    ) -> str:
        """Special tokens decode to nothing, asked to or not, so nothing is spaced apart either;
        the keywords are a real tokenizer's (the detokenizer passes the second only when false)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        return {"<s>": BOS} | {chr(i): i for i in range(256)}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this template has no tool role")
        text = "".join(f"<tools>{t['function']['name']}\n" for t in tools or [])
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    is_aborted: bool = False
    is_running: bool = False
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))


class FakeEngine:
    served_model_name = "fake-model"
    eos_token_ids = (257,)

    def __init__(
        self,
        max_model_len: int = 256,
        max_waiting: int | None = None,
        script: str = "hello world! ",
        can_listen: bool = False,
    ):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.script = script.encode()
        self.requests: dict[str, FakeRequest] = {}
        self.aborted: list[str] = []  # ids of live requests that were aborted
        self.abort_calls: list[str] = []  # every abort() call
        self.gate = asyncio.Event()  # cleared: requests wait in the queue
        self.gate.set()
        self.is_started = False
        self.is_dead = False
        self.can_listen = can_listen  # offer `listen`, as the real engine's fronts do
        self._unread: dict[str, AsyncIterator[RequestOutput]] = {}
        self._pumps: set[asyncio.Task[None]] = set()
        self.listened = 0  # requests streamed through `listen`
        self._counters = EngineStats(num_kv_blocks=64, block_size=16)
        self.on_step: Callable[[float, int, StepLatencies], None] | None = None  # the server's metrics

    @property
    def is_running(self) -> bool:
        return self.is_started and not self.is_dead

    async def start(self) -> None:
        self.is_started = True

    async def shutdown(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        self.is_started = False

    def stats(self) -> EngineStats:
        s = self._counters
        running = sum(r.is_running for r in self.requests.values())
        used = min(s.num_kv_blocks, sum(len(r.prompt) // 16 + 1 for r in self.requests.values()))
        return EngineStats(
            num_running=running,
            num_waiting=len(self.requests) - running,
            num_kv_blocks=s.num_kv_blocks,
            num_free_blocks=s.num_kv_blocks - used,
            block_size=s.block_size,
            kv_usage_ratio=used / s.num_kv_blocks,
            num_prompt_tokens_total=s.num_prompt_tokens_total,
            num_generation_tokens_total=s.num_generation_tokens_total,
            finished_by_reason=dict(s.finished_by_reason),
        )

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, in_group: bool = False
    ) -> AsyncIterator[RequestOutput]:
        if self.is_dead:
            raise EngineDeadError("the engine is dead")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("empty prompt", "prompt")
        if any(not 0 <= t < VOCAB for t in ids):
            raise InvalidRequestError("token id out of vocabulary", "prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds {self.max_model_len}",
                "max_tokens",
            )
        waiting = self.stats().num_waiting
        if self.max_waiting is not None and waiting >= self.max_waiting and not in_group:
            raise QueueFullError("the waiting queue is full", retry_after_s=1.5)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        req = FakeRequest(request_id, ids, params)
        self.requests[request_id] = req
        stream = self._generate(req)
        if self.can_listen:
            self._unread[request_id] = stream
        return stream

    def listen(self, request_id: str, listener: Callable[[RequestOutput | BaseException], None]) -> bool:
        """As StreamFront.listen: the request's outputs go to `listener` as they come (from a task
        here) instead of through its stream; False when this engine does not offer it."""
        stream = self._unread.pop(request_id, None)
        if stream is None:  # listening not offered, or asked twice
            return False

        async def pump() -> None:
            try:
                async for out in stream:
                    listener(out)
            except Exception as e:
                listener(e)

        self.listened += 1
        # As the real engine's step delivery does, call back outside the request's context.
        task = asyncio.create_task(pump(), context=contextvars.Context())
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return True

    def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        req = self.requests.pop(request_id, None)  # its blocks are free at once
        if req is not None:
            req.is_aborted = True
            self.aborted.append(request_id)

    def _token(self, req: FakeRequest, seq: int, step: int) -> int:
        shift = 0 if req.params.is_greedy else (req.params.seed or 0) + seq
        return self.script[(step + shift) % len(self.script)]

    async def _generate(self, req: FakeRequest) -> AsyncIterator[RequestOutput]:
        p = req.params
        seqs = [
            CompletionOutput(index=i, text="", token_ids=[], delta_text="", delta_token_ids=[])
            for i in range(p.n)
        ]
        try:
            while not req.is_aborted and not self.gate.is_set():
                await asyncio.sleep(0.001)
            req.is_running = True
            req.metrics.first_scheduled_time = time.monotonic()
            self._counters.num_prompt_tokens_total += len(req.prompt)
            step = 0
            while True:
                await asyncio.sleep(0.001)
                if req.is_aborted:
                    for s in seqs:
                        s.delta_text, s.delta_token_ids, s.delta_logprobs = "", [], None
                        s.finish_reason = s.finish_reason or "abort"
                    yield self._output(req, seqs, finished=True)
                    return
                for i, s in enumerate(seqs):
                    s.delta_text, s.delta_token_ids, s.delta_logprobs = "", [], None
                    if s.finish_reason is not None:
                        continue
                    tok = self._token(req, i, step)
                    s.token_ids.append(tok)
                    s.delta_token_ids = [tok]
                    s.delta_text = chr(tok)
                    s.text += chr(tok)
                    self._counters.num_generation_tokens_total += 1
                    if p.logprobs is not None:
                        top = [((tok + j) % 256, -0.5 - j) for j in range(p.logprobs)]
                        s.delta_logprobs = [TokenLogprob(tok, -0.5, top)]
                    hit = next((x for x in p.stop if x in s.text), None)
                    if hit is not None:
                        cut = s.text.index(hit)
                        s.delta_text = s.delta_text[: max(0, len(s.delta_text) - (len(s.text) - cut))]
                        s.text = s.text[:cut]
                        s.finish_reason, s.stop_reason = "stop", hit
                    elif len(s.token_ids) >= p.max_tokens:
                        s.finish_reason = "length"
                now = time.monotonic()
                latencies = StepLatencies()
                latencies.tokens_made(req.metrics, now, 1)
                if self.on_step is not None:  # not a batch step: no duration or batched tokens
                    self.on_step(0.0, 0, latencies)
                step += 1
                finished = all(s.finish_reason is not None for s in seqs)
                if finished:
                    req.metrics.finished_time = now
                    for s in seqs:
                        reasons = self._counters.finished_by_reason
                        reasons[s.finish_reason or ""] = reasons.get(s.finish_reason or "", 0) + 1
                yield self._output(req, seqs, finished)
                if finished:
                    return
        finally:
            # Like the real engine: a consumer that leaves early aborts the request.
            if self.requests.get(req.request_id) is req:
                self.requests.pop(req.request_id)
                if not all(s.finish_reason for s in seqs):
                    self.aborted.append(req.request_id)

    @staticmethod
    def _output(req: FakeRequest, seqs: list[CompletionOutput], finished: bool) -> RequestOutput:
        copies = [
            CompletionOutput(
                s.index,
                s.text,
                list(s.token_ids),
                s.delta_text,
                list(s.delta_token_ids),
                s.finish_reason,
                s.stop_reason,
                s.delta_logprobs,
            )
            for s in seqs
        ]
        return RequestOutput(req.request_id, list(req.prompt), copies, finished, req.metrics)
