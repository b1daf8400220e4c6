"""The native decoder stack (model/decode_stack.py): small bf16 decode batches run every layer in one
native call, and compute the same bits as the layer-by-layer path that the same batch would take."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping

import pytest
import torch
from corral_engine import token_appender
from corral_engine.demo_model import write_demo_model
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.attention import AttentionContext
from corral_engine.model.decode_stack import DecodeStack, unsupported
from corral_engine.model.native import NativeKernelError, load_decode_stack_library
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

from tests.engine.helpers import make_engine, random_prompts

pytestmark = pytest.mark.skipif(
    load_decode_stack_library(EngineSettings()) is None, reason="the native kernels cannot be built here"
)


def _engine(model_dir: pathlib.Path) -> LLMEngine:
    # No prefix caching: both paths must see the same prompts computed the same way.
    return make_engine(model_dir, dtype="bfloat16", block_size=8, enable_prefix_caching=False)


def _stack(engine: LLMEngine) -> DecodeStack:
    stack = engine.runner.model.decode_stack
    assert stack is not None, "bf16 on the CPU with the native kernels built: the stack runs"
    return stack


class _Recorder:
    """Every step's logits, and how many rows the stack ran."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.logits: list[torch.Tensor] = []
        self.stack_rows: list[int] = []
        model = engine.runner.model
        compute_logits = model.compute_logits

        def recorded(hidden: torch.Tensor) -> torch.Tensor:
            out = compute_logits(hidden)
            self.logits.append(out.clone())
            return out

        monkeypatch.setattr(model, "compute_logits", recorded)
        run = DecodeStack.__call__

        def counted(stack: DecodeStack, x: torch.Tensor, *args: object) -> torch.Tensor:
            self.stack_rows.append(x.shape[0])
            return run(stack, x, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(DecodeStack, "__call__", counted)


def _generate(engine: LLMEngine, prompts: list[list[int]], tag: str, max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return [final[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def windowed_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A Mistral-style checkpoint whose layers see only the last 6 keys."""
    path = tmp_path_factory.mktemp("models") / "tiny-mistral-window"
    return write_demo_model(path, preset="tiny", arch="mistral", config_overrides={"sliding_window": 6})


@pytest.fixture
def model_dirs(
    tiny_model_dirs: Mapping[str, pathlib.Path], windowed_model_dir: pathlib.Path
) -> Iterator[Mapping[str, pathlib.Path]]:
    yield {
        **{arch: tiny_model_dirs[arch] for arch in ("llama", "qwen2", "qwen3", "phi3")},
        "window": windowed_model_dir,
    }


# plain, qkv bias, q/k norms, window; phi3: weights loaded from fused checkpoint tensors
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "window", "phi3"])
@pytest.mark.parametrize("num_prompts", [1, 2])
def test_the_stack_computes_the_layer_by_layer_bits(
    model_dirs: Mapping[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch, arch: str, num_prompts: int
) -> None:
    engine = _engine(model_dirs[arch])
    stack = _stack(engine)
    assert stack.max_rows > num_prompts  # 3 where bf16 is native, 8 where it is upcast
    recorder = _Recorder(engine, monkeypatch)
    prompts = random_prompts(num_prompts, 500, seed=len(arch) * 10 + num_prompts, min_len=9, max_len=30)
    with_stack = _generate(engine, prompts, "stack-")
    stacked_logits, recorder.logits = recorder.logits, []
    assert recorder.stack_rows == [num_prompts] * 9  # every decode step; the prompt steps go layer by layer
    engine.runner.model.decode_stack = None
    layered = _generate(engine, prompts, "layers-")
    assert layered == with_stack
    assert len(recorder.logits) == len(stacked_logits)
    for got, want in zip(stacked_logits, recorder.logits, strict=True):
        assert torch.equal(got, want)
    assert len(recorder.stack_rows) == 9  # not called with the stack unset


def test_batches_the_stack_does_not_take_go_layer_by_layer(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(
        tiny_model_dir, dtype="bfloat16", block_size=8, enable_prefix_caching=False, max_num_batched_tokens=16
    )
    stack = _stack(engine)
    seen: list[tuple[int, bool, bool]] = []  # (rows, a prompt chunk among them, taken)
    takes = DecodeStack.takes

    def recorded(self: DecodeStack, x: torch.Tensor, ctx: AttentionContext, kv_caches: object) -> bool:
        taken = takes(self, x, ctx, kv_caches)
        seen.append((x.shape[0], bool(ctx.seqs), taken))
        return taken

    monkeypatch.setattr(DecodeStack, "takes", recorded)
    # max_rows prompts in 16-token chunks: chunks beside decodes, then max_rows decodes at once,
    # then fewer as they finish (their lengths differ)
    prompts = random_prompts(stack.max_rows, 500, seed=5, min_len=20, max_len=40)
    _generate(engine, prompts, "wide-", max_tokens=30)
    assert any(prompt for _, prompt, _ in seen)
    assert any(rows == stack.max_rows and not prompt for rows, prompt, _ in seen)
    assert any(taken for _, _, taken in seen)
    for rows, prompt, taken in seen:
        assert taken == (not prompt and rows < stack.max_rows)


def test_a_slot_past_the_cache_raises(tiny_model_dir: pathlib.Path) -> None:
    engine = _engine(tiny_model_dir)
    stack = _stack(engine)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()  # the prompt
    runner = engine.runner
    batch = runner.batches.prepare(engine.scheduler.schedule().scheduled)  # one decode
    with torch.inference_mode():
        assert stack.takes(runner.model.model.embed_tokens(batch.input_ids), batch.ctx, runner.kv_caches)
        batch.ctx.slot_mapping.fill_(runner.num_kv_blocks * runner.block_size)
        with pytest.raises(NativeKernelError, match="past the cache"):
            runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.ctx)


def test_what_the_stack_does_not_take(tiny_model_dir: pathlib.Path) -> None:
    float32 = make_engine(tiny_model_dir, dtype="float32")
    assert float32.runner.model.decode_stack is None  # no small-batch kernel plan for float32
    reason = unsupported(float32.runner.model, float32.runner.kv_caches)
    assert "bf16" in reason
    bf16 = _engine(tiny_model_dir)
    assert unsupported(bf16.runner.model, bf16.runner.kv_caches) == ""
    assert "KV cache" in unsupported(
        bf16.runner.model, [(k.float(), v.float()) for k, v in bf16.runner.kv_caches]
    )
    off = make_engine(tiny_model_dir, EngineSettings(small_batch_kernel="0"), dtype="bfloat16")
    assert off.runner.model.decode_stack is None


def test_gemma3_and_partial_rotary_go_layer_by_layer(
    tiny_model_dirs: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """The C decoder computes Llama's layers: not Gemma 3's norms, GELU and per-layer rotary, nor
    a rotary over part of each head."""
    gemma = _engine(tiny_model_dirs["gemma3"])
    assert gemma.runner.model.decode_stack is None
    assert "Gemma 3" in unsupported(gemma.runner.model, gemma.runner.kv_caches)
    partial = write_demo_model(tmp_path / "m", arch="phi3", config_overrides={"partial_rotary_factor": 0.5})
    engine = _engine(partial)
    assert engine.runner.model.decode_stack is None
    assert unsupported(engine.runner.model, engine.runner.kv_caches) == "partial rotary embeddings"


def test_draft_rows_of_speculative_decoding_match_too(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence verifying drafts is several decode rows over one context (each row sees the keys
    up to itself): the stack takes them, with the same bits as layer by layer. A random-weight
    model seldom repeats itself, so the drafts are its own continuation with the last one wrong:
    some accepted, some rejected."""
    prompts = random_prompts(1, 500, seed=17, min_len=10, max_len=20)
    truth = prompts[0] + _generate(_engine(tiny_model_dir), prompts, "plain-", max_tokens=24)[0]

    def half_right(token_ids: list[int], max_proposals: int, **_: int) -> list[int]:
        drafts = truth[len(token_ids) : len(token_ids) + max_proposals]
        return [*drafts[:-1], (drafts[-1] + 1) % 500] if drafts else []

    monkeypatch.setattr(token_appender.ngram, "propose", half_right)
    engine = make_engine(
        tiny_model_dir,
        dtype="bfloat16",
        block_size=8,
        enable_prefix_caching=False,
        speculative="ngram",
        num_speculative_tokens=3,
    )
    stack = _stack(engine)
    recorder = _Recorder(engine, monkeypatch)
    with_stack = _generate(engine, prompts, "stack-", max_tokens=24)
    stacked_logits, recorder.logits = recorder.logits, []
    assert any(rows > 1 for rows in recorder.stack_rows), "some step verified drafts"
    assert all(rows < stack.max_rows for rows in recorder.stack_rows)
    assert engine.stats().num_spec_accepted_total > 0
    engine.runner.model.decode_stack = None
    assert _generate(engine, prompts, "layers-", max_tokens=24) == with_stack
    assert len(recorder.logits) == len(stacked_logits)
    for got, want in zip(stacked_logits, recorder.logits, strict=True):
        assert torch.equal(got, want)
