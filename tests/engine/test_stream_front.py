"""The step results' hop from the receiving thread to the event loop (`StreamFront`): one output per
step while the loop keeps up; steps posted while it is busy arrive merged per request, in order with
the errors and drops posted between them."""

from __future__ import annotations

import asyncio
import threading

import pytest
from corral_engine.errors import RequestAbortedError
from corral_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from corral_engine.stream_front import StreamFront

_METRICS = RequestMetrics(arrival_time=0.0)


def _step(request_id: str, ids: list[int], finished: bool = False) -> RequestOutput:
    """The output of a step that gave `request_id` its last token, `ids[-1]`."""
    text = "".join(chr(96 + i) for i in ids)
    out = CompletionOutput(0, text, list(ids), text[-1], ids[-1:], "length" if finished else None)
    return RequestOutput(request_id, [1, 2], [out], finished, _METRICS)


def _open(front: StreamFront, request_id: str, seen: list[tuple[str, object]]) -> None:
    front._streams.open(request_id, lambda _: None)
    front.listen(request_id, lambda item: seen.append((request_id, item)))


def _summary(seen: list[tuple[str, object]]) -> list[tuple[str, object]]:
    return [
        (rid, item.outputs[0].delta_token_ids if isinstance(item, RequestOutput) else type(item).__name__)
        for rid, item in seen
    ]


async def _posted_from_thread(front: StreamFront, post, *, loop_busy: bool) -> None:
    """Run `post()` on a thread; with `loop_busy`, the event loop is blocked until it returns."""
    front._loop = asyncio.get_running_loop()
    thread = threading.Thread(target=post)
    thread.start()
    if loop_busy:
        thread.join()  # blocks the loop: nothing posted is taken until post() has returned
    else:
        await asyncio.to_thread(thread.join)
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_loop_that_keeps_up_gets_each_step_as_it_comes() -> None:
    front = StreamFront()
    seen: list[tuple[str, object]] = []
    delivered = threading.Event()

    async def main() -> None:
        _open(front, "a", seen)
        loop = asyncio.get_running_loop()

        def post() -> None:
            for ids in ([1], [1, 2], [1, 2, 3]):
                delivered.clear()
                front._deliver([_step("a", ids, finished=len(ids) == 3)])
                loop.call_soon_threadsafe(delivered.set)
                delivered.wait(5)

        await _posted_from_thread(front, post, loop_busy=False)

    asyncio.run(main())
    assert _summary(seen) == [("a", [1]), ("a", [2]), ("a", [3])]
    assert "a" not in front._streams  # the finished output took the listener out


def test_steps_posted_while_the_loop_is_busy_arrive_merged_in_order_with_errors_and_drops() -> None:
    front = StreamFront()
    seen: list[tuple[str, object]] = []
    wakeups: list[int] = []

    async def main() -> None:
        for rid in ("a", "b", "c"):
            _open(front, rid, seen)
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            wakeups.append(1)
            return call_soon_threadsafe(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def post() -> None:
            front._deliver([_step("a", [1]), _step("b", [4])])
            front._deliver([_step("a", [1, 2]), _step("b", [4, 5])])
            front._deliver_error("b", ValueError("b failed"))
            front._deliver([_step("a", [1, 2, 3]), _step("c", [7])])
            front._deliver_dropped("c")
            front._deliver([_step("a", [1, 2, 3, 4], finished=True)])

        await _posted_from_thread(front, post, loop_busy=True)

    asyncio.run(main())
    assert wakeups == [1]  # one wake-up for all six
    assert _summary(seen) == [
        ("a", [1, 2]),  # the two steps before the error, merged
        ("b", [4, 5]),
        ("b", "ValueError"),
        ("a", [3]),
        ("c", [7]),
        ("c", "RequestAbortedError"),  # the drop ends a consumer still listening
        ("a", [4]),  # after the drop
    ]
    merged = seen[0][1]
    assert isinstance(merged, RequestOutput)
    assert (merged.outputs[0].text, merged.outputs[0].token_ids) == ("ab", [1, 2])
    assert front._streams.keys() == {"b"}  # the error is the stream's to end; c dropped, a finished


def test_a_request_dropped_before_the_engine_took_it_ends_its_stream() -> None:
    """An abort that finds the request not yet in the engine gives no final output; a consumer
    still reading (a non-streamed request waiting for its aborted output's token counts) waited
    for ever."""
    front = StreamFront()

    async def main() -> None:
        stream = front._streams.open("q", lambda _: None)
        await _posted_from_thread(front, lambda: front._deliver_dropped("q"), loop_busy=False)
        with pytest.raises(RequestAbortedError, match="aborted before it started"):
            await asyncio.wait_for(anext(aiter(stream)), 5)

    asyncio.run(main())
    assert not front._streams


def test_a_post_to_a_closed_loop_raises_and_leaves_nothing_for_the_next_loop() -> None:
    front = StreamFront()
    closed = asyncio.new_event_loop()
    closed.close()
    front._loop = closed
    with pytest.raises(RuntimeError):
        front._deliver([_step("a", [1])])
    seen: list[tuple[str, object]] = []

    async def main() -> None:
        _open(front, "a", seen)
        await _posted_from_thread(front, lambda: front._deliver([_step("a", [1, 2])]), loop_busy=False)

    asyncio.run(main())
    assert _summary(seen) == [("a", [2])]
