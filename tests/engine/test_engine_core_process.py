"""The engine core in a process of its own (`EngineCoreClient`, CORRAL_ENGINE_PROCESS=1): the same
outputs as in one process, a hang-up frees its blocks, bad requests refused at once, a dead core
fails its streams, and shutdown stops the child."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import signal

import pytest
from corral_engine import AsyncEngine, EngineArgs, EngineCoreClient, SamplingParams
from corral_engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from corral_engine.outputs import StepLatencies
from corral_engine.settings import EngineSettings
from corral_engine.structured.spec import GrammarSpec


def _args(model_dir: pathlib.Path) -> EngineArgs:
    return EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=128)


async def _wait_for(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def _run(engine: AsyncEngine | EngineCoreClient, prompts: list[str], params: SamplingParams) -> list:  # type: ignore[type-arg]
    async def one(i: int, prompt: str) -> tuple[str, list[int], list[int], str | None]:
        text = ""
        async for out in engine.add_request(f"r{i}", prompt, params):
            text += out.outputs[0].delta_text
        return text, out.outputs[0].token_ids, out.prompt_token_ids, out.outputs[0].finish_reason

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


# CUDA's defaults, run here: the next step launched before this one's tokens reach the host, and
# a step's text work done in the next.
CUDA_DEFAULTS = EngineSettings(async_scheduling="1", overlap_output="1")


@pytest.mark.parametrize("core_settings", [None, CUDA_DEFAULTS], ids=["cpu-defaults", "cuda-defaults"])
async def test_same_outputs_as_one_process(
    tiny_model_dir: pathlib.Path, core_settings: EngineSettings | None
) -> None:
    """The core process gives one process's outputs, also with the switches CUDA turns on (async
    scheduling, output overlap) against a plain one-process engine."""
    prompts = ["hello world", "the quick brown fox", "a", "counting: one two three"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    results = []
    plain = EngineSettings(async_scheduling="0", overlap_output="0")
    engines = (
        AsyncEngine(_args(tiny_model_dir), settings=plain),
        EngineCoreClient(_args(tiny_model_dir), core_settings),
    )
    for engine in engines:
        await engine.start()
        try:
            results.append((await _run(engine, prompts, greedy), await _run(engine, prompts, seeded)))
            stats = engine.stats()
            assert stats.num_generation_tokens_total == 4 * 24 + sum(len(r[1]) for r in results[-1][1])
        finally:
            await engine.shutdown()
    in_process, own_process = results
    assert own_process == in_process
    for _text, ids, prompt_ids, reason in own_process[0]:
        assert len(ids) == 24 and reason == "length" and prompt_ids  # prompts restored on this side


async def test_hang_up_frees_blocks_and_bad_requests_refused_at_once(tiny_model_dir: pathlib.Path) -> None:
    engine = EngineCoreClient(_args(tiny_model_dir))
    await engine.start()
    try:
        steps: list[int] = []
        latencies = StepLatencies()

        def on_step(duration_s: float, num_tokens: int, step: StepLatencies) -> None:
            steps.append(num_tokens)
            latencies.ttft_s += step.ttft_s
            latencies.itl_s += step.itl_s

        engine.on_step = on_step
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [engine.add_request(f"a{i}", "abort me", long) for i in range(3)]
        for stream in streams:
            await anext(stream)
            await stream.aclose()  # a client hanging up
        await _wait_for(lambda: engine.stats().num_running == 0 and engine.stats().kv_usage_ratio == 0.0)
        assert engine.stats().finished_by_reason.get("abort") == 3
        assert steps and all(n > 0 for n in steps)
        # Each request's first token crossed from the core as one time to first token.
        assert len(latencies.ttft_s) == 3 and all(t >= 0 for t in latencies.ttft_s + latencies.itl_s)
        assert await engine.wait_idle(5.0)

        with pytest.raises(InvalidRequestError) as too_long:
            engine.add_request("x", [1] * engine.max_model_len, SamplingParams(max_tokens=4))
        assert too_long.value.param == "prompt"
        with pytest.raises(InvalidRequestError) as bad_id:
            engine.add_request("y", [1, 10**9], SamplingParams(max_tokens=4))
        assert bad_id.value.param == "prompt"
        bad_grammar = SamplingParams(max_tokens=4, grammar=GrammarSpec("regex", "(unclosed"))
        with pytest.raises(InvalidRequestError):
            engine.add_request("z", "hi", bad_grammar)
        ok = [out async for out in engine.add_request("x", "fine", SamplingParams(max_tokens=2))]
        assert ok[-1].finished  # the refused ids were never sent: "x" is free
    finally:
        await engine.shutdown()
    assert engine._process.exitcode == 0


async def test_a_dead_core_fails_its_streams(tiny_model_dir: pathlib.Path) -> None:
    engine = EngineCoreClient(_args(tiny_model_dir))
    await engine.start()
    try:
        stream = engine.add_request("s", "keep going", SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        assert engine._process.pid is not None
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.add_request("t", "more", SamplingParams(max_tokens=2))
    finally:
        await engine.shutdown()


def test_a_model_that_cannot_load_is_reported(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelLoadError):
        EngineCoreClient(EngineArgs(model=str(tmp_path), dtype="float32"))


def test_outputs_cross_the_pipe_whole() -> None:
    """Every field of an output survives the tuples it travels as (a field added to the dataclasses
    and not to `pack_outputs` fails here), the prompt's ids restored from the server's side."""
    from corral_engine.core_messages import pack_outputs, unpack_outputs
    from corral_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

    completion = CompletionOutput(
        1, "ab", [5, 6], "b", [6], "stop", "</s>", [TokenLogprob(6, -0.5, [(6, -0.5), (7, -1.0)], 1)]
    )
    metrics = RequestMetrics(1.0, 2.0, 3.0, 4.0, 5.0, 6, 7)
    out = RequestOutput("r", [1, 2, 3], [completion], True, metrics, [None, TokenLogprob(2, -1.0, [], None)])
    prompts = {"r": [1, 2, 3]}
    (packed,) = pack_outputs([out])
    assert len(packed[1][0]) == len(dataclasses.fields(CompletionOutput))
    assert len(packed[3]) == len(dataclasses.fields(RequestMetrics))
    assert unpack_outputs([packed], prompts) == [out]
    assert prompts == {}  # a final output takes its prompt's record with it


class _GoneProcess:
    exitcode = 1

    def join(self, timeout: float | None = None) -> None:
        pass


def _reader_of(*messages: tuple[object, ...], close: bool = False) -> tuple[EngineCoreClient, list[str]]:
    """A client whose pipe from the core holds `messages` (then closed, with `close`), and the
    reasons its `on_core_exit` will be called with."""
    import multiprocessing
    import pickle

    from corral_engine.core_messages import PROTOCOL

    reader, writer = multiprocessing.Pipe(duplex=False)
    client = EngineCoreClient.__new__(EngineCoreClient)
    client._from_core, client._process, client._loop = reader, _GoneProcess(), None  # type: ignore[assignment]
    client._running, client._dead, client._prompts, client._lora_replies = True, None, {}, {}
    exits: list[str] = []
    client.on_core_exit = exits.append
    for message in messages:
        writer.send_bytes(pickle.dumps(message, protocol=PROTOCOL))
    if close:
        writer.close()
    return client, exits


@pytest.mark.parametrize("then", ["stopped", "eof"])
def test_a_core_whose_loop_died_is_reported_gone_once(then: str) -> None:
    """The core reports its dead step loop, then its process ends (a clean "stopped", or the pipe
    closing when a dead tensor-parallel rank ended it first): the replica exits either way, with
    the loop's reason, once. (It once stayed up when the report came before the exit.)"""
    dead = ("dead", "EngineDeadError: rank 1 exited")
    client, exits = _reader_of(dead, ("stopped",)) if then == "stopped" else _reader_of(dead, close=True)
    client._read()
    assert exits == ["the engine failed: EngineDeadError: rank 1 exited"]
    assert not client.is_running


def test_a_core_stopped_on_request_is_not_reported_gone() -> None:
    client, exits = _reader_of(("stopped",))
    client._read()
    assert exits == []
