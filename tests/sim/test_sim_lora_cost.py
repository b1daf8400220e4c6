"""What LoRA adds to a simulated step: an adapter's bytes from its shapes, a slot load when a step
first runs an adapter not in a slot, nothing for steps without adapters. No torch."""

from __future__ import annotations

import pytest
from corral_engine.lora import LoraRequest
from corral_engine.sampling_params import SamplingParams
from corral_engine.sim.engine import NullTokenizer, SimEngine
from corral_engine.sim.lora_cost import ALL_TARGETS, adapter_params, lora_cost
from corral_engine.sim.perf_model import BUILTIN, LLAMA3_8B

PROFILE = BUILTIN["h100-llama3-8b"]
COST = lora_cost(PROFILE)
SQL, CHAT = LoraRequest("sql", 1, ""), LoraRequest("chat", 2, "")


def test_a_rank_16_llama3_8b_adapter_on_every_projection_is_84_mb() -> None:
    # Per layer r x (in + out): q and o 4096 + 4096, k and v 4096 + 1024, gate/up/down 4096 + 14336.
    assert adapter_params(LLAMA3_8B, 14336, 16, ALL_TARGETS) == 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)
    assert COST.adapter_bytes == pytest.approx(83.9e6, rel=1e-3)
    assert 2e-3 < COST.load_s < 5e-3  # over PCIe Gen5 at 25 GB/s
    assert COST.step_time_s(0, 0, 0) == 0.0
    # A decode step's share: 4 adapters read once each, well under the base model's ~6 ms.
    assert COST.step_time_s(0, 4, 64) < 0.5e-3 < COST.step_time_s(1, 4, 64)


def _step(engine: SimEngine, request_id: str, lora: LoraRequest | None) -> float:
    """The duration of a step running one new request of `lora` (its whole 32-token prompt, of
    its own tokens, so no step finds another's prefix cached)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    first = 3 + 100 * (sum(map(ord, request_id)) % 100)
    prompt = list(range(first, first + 32))
    engine.insert_request(engine.make_request(request_id, prompt, params, lora=lora))
    step = engine.begin_step()
    assert step is not None
    engine.finish_step(step)
    return step.duration_s


def test_a_step_pays_a_slot_load_only_for_an_adapter_not_in_a_slot() -> None:
    engine = SimEngine(PROFILE, NullTokenizer(), "sim", is_lean=True, max_loras=1, lora_cost=COST)
    plain = SimEngine(PROFILE, NullTokenizer(), "sim", is_lean=True)
    base = _step(plain, "b", None)
    assert _step(engine, "b", None) == base  # no adapter in the step: nothing added
    first = _step(engine, "s1", SQL)
    again = _step(engine, "s2", SQL)  # still in its slot
    assert first - again == pytest.approx(COST.load_s)
    assert again > base
    _step(engine, "c1", CHAT)  # one slot: chat takes sql's
    assert _step(engine, "s3", SQL) == pytest.approx(first)
    assert engine.num_lora_loads_total == 3


def test_without_a_cost_adapters_take_no_step_time() -> None:
    engine = SimEngine(PROFILE, NullTokenizer(), "sim", is_lean=True, max_loras=2)
    plain = SimEngine(PROFILE, NullTokenizer(), "sim", is_lean=True)
    assert _step(engine, "s", SQL) == _step(plain, "b", None)
