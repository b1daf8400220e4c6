"""LoRA without giving up the fast paths: steps with no adapter row still take the native decode
stack (CPU) and the decode graphs (EagerCapture stands in for CUDA graphs), steps with one go layer
by layer; and bf16 adapter slots are float32 where the base upcasts bf16 (a CPU without native
bf16). Greedy tokens are checked in mixed runs of base-only and adapter steps."""

from __future__ import annotations

import pathlib

import pytest
import torch
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.lora import LoraRequest
from corral_engine.model import runner as runner_mod
from corral_engine.model.cuda_graphs import EagerCapture
from corral_engine.model.decode_stack import DecodeStack
from corral_engine.model.device import CpuFeatures
from corral_engine.model.lora import fast_paths, lora_slot_dtype
from corral_engine.model.matmul_plan import MatmulPlan
from corral_engine.model.native import load_decode_stack_library
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

from tests.engine.helpers import make_engine, peft_greedy, random_prompts

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
EMULATED = CpuFeatures(has_native_bf16=False, has_onednn=True)  # AVX2: bf16 upcast to float32
NATIVE = CpuFeatures(has_native_bf16=True, has_onednn=True)
UPCAST = MatmulPlan(upcast_min_rows=8, prepack=False, keep_upcast_copies=True)
NO_UPCAST = MatmulPlan(upcast_min_rows=0, prepack=True, keep_upcast_copies=False)
HAS_STACK = load_decode_stack_library(EngineSettings()) is not None


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_adapter(tiny_model_dir, tmp_path_factory.mktemp("fast") / "a", rank=8, seed=5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, 500, seed=11, min_len=5, max_len=20)


def test_fast_paths_only_for_steps_without_adapter_rows() -> None:
    stack, graphs = object(), object()
    assert fast_paths(False, stack, graphs) == (stack, graphs)
    assert fast_paths(True, stack, graphs) == (None, None)
    assert fast_paths(False, None, None) == (None, None)  # none built (GPU without graphs, TP)


@pytest.mark.parametrize(
    ("dtype", "plan", "mode", "want"),
    [
        (torch.bfloat16, UPCAST, "auto", torch.float32),  # CPU without native bf16
        (torch.bfloat16, NO_UPCAST, "auto", torch.bfloat16),  # native bf16, or CUDA
        (torch.bfloat16, UPCAST, "0", torch.bfloat16),
        (torch.bfloat16, NO_UPCAST, "1", torch.float32),
        (torch.float32, UPCAST, "auto", torch.float32),
        (torch.float16, NO_UPCAST, "1", torch.float16),
    ],
)
def test_slot_dtype(dtype: torch.dtype, plan: MatmulPlan, mode: str, want: torch.dtype) -> None:
    assert lora_slot_dtype(dtype, plan, mode) == want  # type: ignore[arg-type]


class _Spy:
    """Rows of each decode-stack call, and the LoRA groups each step ran with."""

    def __init__(self, engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
        self.stack_rows: list[int] = []
        self.adapter_steps = 0
        run = DecodeStack.__call__

        def counted(stack: DecodeStack, x: torch.Tensor, *args: object) -> torch.Tensor:
            self.stack_rows.append(x.shape[0])
            return run(stack, x, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(DecodeStack, "__call__", counted)
        slots = engine.runner.lora
        prepare = slots.prepare

        def prepared(scheduled):  # type: ignore[no-untyped-def]
            prepare(scheduled)
            self.adapter_steps += bool(slots.groups)

        monkeypatch.setattr(slots, "prepare", prepared)


def _mixed(engine, prompts: list[list[int]], lora: LoraRequest | None) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Base-only requests, then one adapter request beside a base one, then base-only again."""
    final: dict[str, list[int]] = {}
    for phase, names in enumerate([("base", "base"), ("lora", "base"), ("base",)]):
        for i, name in enumerate(names):
            engine.add_request(
                f"{phase}-{i}-{name}", prompts[i], GREEDY, lora=lora if name == "lora" else None
            )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0].token_ids
    return final


@pytest.mark.skipif(not HAS_STACK, reason="the native kernels cannot be built here")
def test_decode_stack_runs_base_only_steps_of_a_lora_engine_in_bf16(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapter, prompts, monkeypatch
) -> None:
    monkeypatch.setattr(runner_mod, "probe_cpu", lambda: EMULATED)
    kwargs = {"dtype": "bfloat16", "block_size": 8, "enable_prefix_caching": False}
    plain = make_engine(tiny_model_dir, **kwargs)
    engine = make_engine(tiny_model_dir, enable_lora=True, lora_modules=(f"a={adapter}",), **kwargs)
    slots = engine.runner.lora  # type: ignore[union-attr]
    assert slots is not None and slots.dtype == torch.float32  # bf16 upcast here: float32 slots
    assert {t.dtype for layer in set(slots.layers.values()) for t in layer.a.values()} == {torch.float32}
    assert engine.runner.decode_stack is not None  # type: ignore[union-attr]
    spy = _Spy(engine, monkeypatch)
    got = _mixed(engine, prompts, LoraRequest("a", 1, str(adapter)))
    # Every base-only decode step took the stack; no step with an adapter row did.
    assert spy.adapter_steps >= MAX_NEW  # the adapter request's prefill and decodes
    num_base_decodes = 2 * (MAX_NEW - 1)  # phases 0 and 2 (phase 1 has an adapter row every step)
    assert len(spy.stack_rows) == num_base_decodes
    base = _mixed(plain, prompts, None)  # the "lora" request runs on the base model there
    for request_id, tokens in got.items():
        if request_id.endswith("base"):
            assert tokens == base[request_id]


def test_float32_slots_for_bf16_keep_the_adapters_tokens(
    tiny_model_dir, adapter, prompts, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """bf16 with float32 slots, and with slots in bf16 (CORRAL_LORA_UPCAST=0): both give peft's
    float32 tokens on these prompts."""
    monkeypatch.setattr(runner_mod, "probe_cpu", lambda: EMULATED)
    expected = peft_greedy(tiny_model_dir, adapter, prompts, MAX_NEW)
    lora = LoraRequest("a", 1, str(adapter))
    for mode, slot_dtype in (("auto", torch.float32), ("0", torch.bfloat16)):
        engine = make_engine(
            tiny_model_dir,
            EngineSettings(lora_upcast=mode),  # type: ignore[arg-type]
            dtype="bfloat16",
            enable_lora=True,
            lora_modules=(f"a={adapter}",),
        )
        assert engine.runner.lora.dtype == slot_dtype  # type: ignore[union-attr]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY, lora=lora)
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0].token_ids
        assert [final[f"r{i}"] for i in range(len(prompts))] == expected, mode


INTERPRET = EngineSettings(triton_interpret=True, triton_ops="0")


def test_decode_graphs_replay_base_only_steps_of_a_lora_engine(tiny_model_dir, adapter, prompts) -> None:  # type: ignore[no-untyped-def]
    """The triton backend with EagerCapture as the graph runner: graphs are captured with LoRA on
    and replay exactly the steps without adapter rows; the tokens match peft's."""
    lora = LoraRequest("a", 1, str(adapter))
    capture = EagerCapture()
    engine = make_engine(
        tiny_model_dir,
        INTERPRET,
        graph_capture=capture,
        attention_backend="triton",
        block_size=8,
        max_num_seqs=2,
        num_kv_blocks=24,
        enable_lora=True,
        lora_modules=(f"a={adapter}",),
    )
    assert capture.captured == [2, 1]
    final = _mixed(engine, prompts, lora)
    num_base_decodes = 2 * (MAX_NEW - 1)  # phases 0 and 2 (phase 1 has an adapter row every step)
    assert len(capture.replayed) == num_base_decodes
    expected_lora = peft_greedy(tiny_model_dir, adapter, prompts[:1], MAX_NEW)
    expected_base = peft_greedy(tiny_model_dir, None, prompts[:2], MAX_NEW)
    assert final["1-0-lora"] == expected_lora[0]
    assert final["0-0-base"] == final["2-0-base"] == expected_base[0]
    assert final["0-1-base"] == final["1-1-base"] == expected_base[1]
