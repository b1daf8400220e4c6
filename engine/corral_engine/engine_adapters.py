"""The LoRA adapters an engine holds on its runner: registered at start and on request, read
again from their paths when the host cache dropped their weights (a request whose adapter can no
longer be read fails), and unloaded once no request of theirs is left (light; no torch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.core.sequence import Request
from corral_engine.errors import InvalidRequestError
from corral_engine.lora import AdapterError, LoraRequest


class AdapterHost(Protocol):
    """What the bookkeeping needs of the runner (ModelRunner, ParallelRunner)."""

    def add_lora(self, lora: LoraRequest) -> None: ...

    def remove_lora(self, lora_id: int) -> None: ...

    def stage_lora(self, lora_id: int) -> None: ...


class EngineAdapters:
    def __init__(self, runner: AdapterHost) -> None:
        self._runner = runner
        # Adapters unloaded (a thread-safe queue: any thread appends, the step thread drains),
        # dropped from the runner once no request of theirs is left.
        self._removals: deque[int] = deque()
        self._removing: set[int] = set()

    def add(self, lora: LoraRequest) -> None:
        """Read and register an adapter; AdapterError when it cannot be served."""
        self._runner.add_lora(lora)

    def stage(self, lora: LoraRequest) -> None:
        """Have a request's adapter ready: its weights read again if they were dropped from host
        memory. InvalidRequestError (400, as vLLM refuses an adapter it cannot load) when it can
        no longer be read."""
        try:
            self._runner.stage_lora(lora.lora_id)
        except AdapterError as e:
            raise InvalidRequestError(f"The adapter '{lora.name}' cannot be served: {e}", "model") from None

    def unservable(self, scheduled: list[ScheduledSeq]) -> dict[str, str]:
        """Requests of a step whose adapter can no longer be read (dropped from host memory
        again after its request was admitted, its files gone since): request id -> why."""
        failed: dict[int, str] = {}
        for lora in {lora for s in scheduled if (lora := s.seq.request.lora) is not None}:
            try:
                self._runner.stage_lora(lora.lora_id)
            except AdapterError as e:
                failed[lora.lora_id] = f"The adapter '{lora.name}' cannot be served: {e}"
        return {
            s.seq.request.request_id: failed[lora_id]
            for s in scheduled
            if (lora_id := s.lora_id()) is not None and lora_id in failed
        }

    def remove(self, lora_id: int) -> None:
        """Unregister an adapter (from any thread); its weights go once its requests are done."""
        self._removals.append(lora_id)

    @property
    def has_removals(self) -> bool:
        return bool(self._removals or self._removing)

    def drop_unused(self, requests: Iterable[Request]) -> None:
        """Unload the removed adapters that no request of `requests` (the engine's) runs with."""
        while self._removals:
            self._removing.add(self._removals.popleft())
        in_use = {r.lora.lora_id for r in requests if r.lora is not None}
        for lora_id in self._removing - in_use:
            self._runner.remove_lora(lora_id)
        self._removing &= in_use
