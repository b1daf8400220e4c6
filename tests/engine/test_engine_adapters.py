"""EngineAdapters: a removed adapter stays on the runner while a request of its own is left."""

from __future__ import annotations

from corral_engine.core.sequence import Request
from corral_engine.engine_adapters import EngineAdapters
from corral_engine.lora import LoraRequest
from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams


class FakeRunner:
    def __init__(self) -> None:
        self.loaded: set[int] = set()

    def add_lora(self, lora: LoraRequest) -> None:
        self.loaded.add(lora.lora_id)

    def remove_lora(self, lora_id: int) -> None:
        self.loaded.remove(lora_id)  # KeyError: removed twice


def _request(lora: LoraRequest | None) -> Request:
    return Request("r", [1, 2], SamplingParams(max_tokens=1), 0, RequestMetrics(0.0), lora=lora)


def test_removed_adapter_goes_once_its_requests_are_done() -> None:
    runner = FakeRunner()
    adapters = EngineAdapters(runner)
    a, b = LoraRequest("a", 1, "/a"), LoraRequest("b", 2, "/b")
    adapters.add(a)
    adapters.add(b)
    assert not adapters.has_removals
    adapters.remove(1)
    adapters.remove(2)
    assert adapters.has_removals
    adapters.drop_unused([_request(a), _request(None)])
    assert runner.loaded == {1}  # b had no request left; a's request still runs
    assert adapters.has_removals
    adapters.drop_unused([_request(a)])
    assert runner.loaded == {1}
    adapters.drop_unused([])
    assert runner.loaded == set()
    assert not adapters.has_removals
    adapters.drop_unused([])  # nothing is removed twice
