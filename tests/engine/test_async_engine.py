"""The asyncio front: streaming outputs, early exit aborts and frees blocks, queue limit."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from corral_engine import AsyncEngine, EngineArgs, SamplingParams
from corral_engine.errors import EngineDeadError, QueueFullError
from corral_engine.settings import EngineSettings, Switch


async def _wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("overlap", ["0", "1"])
async def test_streams_and_aborts(tiny_model_dir: pathlib.Path, overlap: Switch) -> None:
    """Also with the output overlap on (each step's outputs come with the next step's)."""
    engine = AsyncEngine(
        EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128),
        settings=EngineSettings(overlap_output=overlap),
    )
    assert engine.engine.overlaps_output is (overlap == "1")
    await engine.start()
    try:
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

        async def collect(i: int) -> tuple[str, list[int]]:
            text = ""
            async for out in engine.add_request(f"s{i}", "hello world", greedy):
                text += out.outputs[0].delta_text
            return text, out.outputs[0].token_ids

        results = await asyncio.gather(*(collect(i) for i in range(6)))
        assert len({r[1].__repr__() for r in results}) == 1 and len(results[0][1]) == 16
        assert results[0][0] == engine.tokenizer.decode(results[0][1], skip_special_tokens=True)

        long = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [engine.add_request(f"a{i}", "abort me", long) for i in range(5)]
        for stream in streams:
            await anext(stream)
            await stream.aclose()  # a client hanging up
        await _wait_for(lambda: engine.stats().num_running == 0 and engine.stats().kv_usage_ratio == 0.0)
        assert engine.stats().finished_by_reason.get("abort") == 5
    finally:
        await engine.shutdown()


async def test_waiting_queue_limit(tiny_model_dir: pathlib.Path) -> None:
    engine = AsyncEngine(
        EngineArgs(
            model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=1, max_waiting=2
        )
    )
    await engine.start()
    try:
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        accepted = []
        rejected = 0
        for i in range(8):
            try:
                accepted.append(engine.add_request(f"q{i}", [1, 2, 3], params))
            except QueueFullError as e:
                rejected += 1
                assert e.retry_after_s > 0
        assert rejected > 0 and len(accepted) >= 2
        # another prompt of an admitted request gets in past the limit (the server's grouping)
        accepted.append(engine.add_request("q0-1", [1, 2, 3], params, in_group=True))

        async def drain(stream) -> str | None:  # type: ignore[no-untyped-def]
            reason = None
            async for out in stream:
                reason = out.outputs[0].finish_reason
            return reason

        assert await asyncio.gather(*(drain(s) for s in accepted)) == ["length"] * len(accepted)
    finally:
        await engine.shutdown()


async def test_stats_count_as_waiting_only_what_the_scheduler_could_not_start(
    tiny_model_dir: pathlib.Path,
) -> None:
    engine = AsyncEngine(
        EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    )
    await engine.start()
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        streams = [engine.add_request(f"w{i}", [1, 2, 3], params) for i in range(5)]
        await anext(streams[0])
        # Once steps have run after all five arrived: two run, three wait for a seat.
        await _wait_for(lambda: (engine.stats().num_running, engine.stats().num_waiting) == (2, 3))
        for stream in streams:
            await stream.aclose()
        await _wait_for(lambda: engine.stats().num_running + engine.stats().num_waiting == 0)
    finally:
        await engine.shutdown()


def test_light_modules_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, corral_engine, corral_engine.args, corral_engine.wire, corral_engine.errors; "
        "from corral_engine import EngineArgs, SamplingParams; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


async def test_a_consumer_that_falls_behind_gets_the_queued_outputs_as_one(
    tiny_model_dir: pathlib.Path,
) -> None:
    engine = AsyncEngine(EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64))
    await engine.start()
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        stream = engine.add_request("slow", "hello world", params)
        first = await anext(stream)
        await _wait_for(lambda: engine.stats().num_running == 0)  # the rest is generated meanwhile
        rest = [out async for out in stream]
        assert len(rest) == 1 and rest[0].finished
        head, tail = first.outputs[0], rest[0].outputs[0]
        assert head.delta_token_ids + tail.delta_token_ids == tail.token_ids and len(tail.token_ids) == 24
        assert head.delta_text + tail.delta_text == tail.text
    finally:
        await engine.shutdown()


async def test_an_error_behind_queued_outputs_comes_after_them(tiny_model_dir: pathlib.Path) -> None:
    engine = AsyncEngine(EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64))
    await engine.start()
    try:
        stream = engine.add_request("e", "hello", SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        queue = engine._streams["e"]
        await _wait_for(lambda: queue.qsize() >= 3)
        queue.put_nowait(EngineDeadError("the engine failed"))  # as the step loop reports a crash
        merged = await anext(stream)
        assert len(merged.outputs[0].delta_token_ids) >= 3 and not merged.finished
        with pytest.raises(EngineDeadError):
            await anext(stream)
    finally:
        await engine.shutdown()


def test_the_engine_is_built_off_the_event_loops_thread(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenMP keeps a worker team per thread that ran parallel work, for that thread's life; one
    left on the event loop's thread beside the step thread's makes libgomp stop spinning between
    regions (docs/engine-speed.md, item 14). So the model loads on a thread that is gone once
    AsyncEngine exists, and a load failure still reaches the caller."""
    import threading

    from corral_engine import async_engine

    loaders: list[threading.Thread] = []
    real = async_engine.LLMEngine

    def recording(*args: object, **kwargs: object) -> object:
        loaders.append(threading.current_thread())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(async_engine, "LLMEngine", recording)
    engine = AsyncEngine(EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64))
    assert engine.engine.model_config is not None
    (loader,) = loaders
    assert loader is not threading.current_thread() and not loader.is_alive()
    with pytest.raises(Exception, match="no-such-model"):
        AsyncEngine(EngineArgs(model=str(tiny_model_dir / "no-such-model"), dtype="float32"))


async def test_a_listener_gets_what_was_queued_then_each_output_as_it_comes(
    tiny_model_dir: pathlib.Path,
) -> None:
    """The server's streaming path: outputs handed to a callback on the event loop, no queue."""
    engine = AsyncEngine(EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64))
    await engine.start()
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = engine.add_request("l", "hello world", params)
        queue = engine._streams["l"]
        assert isinstance(queue, asyncio.Queue)
        while queue.qsize() < 2:  # not the 20 ms polls of _wait_for: it must not finish meanwhile
            await asyncio.sleep(0.001)
        got: list[object] = []
        done = asyncio.Event()

        def listener(item: object) -> None:
            got.append(item)
            if getattr(item, "finished", False):
                done.set()

        assert engine.listen("l", listener)
        assert len(got) >= 2  # what had been queued, at once
        await asyncio.wait_for(done.wait(), 20)
        outs = [o.outputs[0] for o in got]  # type: ignore[attr-defined]
        assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids
        assert len(outs[-1].token_ids) == 200 and "".join(o.delta_text for o in outs) == outs[-1].text
        assert "l" not in engine._streams  # the final output took the listener out
        assert not engine.listen("l", listener)  # finished: nothing to listen to
        await stream.aclose()  # never iterated: closing it does nothing

        # Aborting a listened-to request: its final output (abort) comes to the listener too.
        engine.add_request("m", "hello", SamplingParams(max_tokens=400, ignore_eos=True))
        got.clear()
        done.clear()
        assert engine.listen("m", listener)
        await _wait_for(lambda: len(got) >= 2)
        engine.abort("m")
        await asyncio.wait_for(done.wait(), 20)
        assert got[-1].outputs[0].finish_reason == "abort"  # type: ignore[attr-defined]
        await _wait_for(lambda: engine.stats().num_running == 0 and engine.stats().kv_usage_ratio == 0.0)
    finally:
        await engine.shutdown()
