"""Server-Sent Events as OpenAI sends them, and a streaming response that always cleans up.

The response takes a generation's outputs through its listener where the engine offers one: each
step's outputs are encoded and written from the engine's one callback per step, no task woken and
no queue per token; else it reads the run's stream. It watches the client's connection itself
(whatever ASGI spec the server speaks), and on any exit closes the run, which aborts unfinished
engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Coroutine
from types import CoroutineType
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from corral_engine.outputs import RequestOutput
from corral_engine.server import access, errors
from corral_engine.server.generation import GenerationRun, wait_for_disconnect

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# json.dumps builds a new encoder per call unless every option is the default; build it once.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_NO_USAGE = object()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


class ChunkEncoder:
    """One streamed response's chunks, `{**base, "choices": [...], **tail}` as SSE events. The
    fields every chunk repeats (id, object, created, model, and "usage": null when the client
    asked for usage) are encoded once per response instead of once per token."""

    def __init__(self, base: dict[str, Any], include_usage: bool) -> None:
        self._head = b"data: " + _JSON.encode(base)[:-1].encode() + b',"choices":'
        self._tail = (b',"usage":null' if include_usage else b"") + b"}\n\n"

    def chunk(self, choices: list[dict[str, Any]], usage: Any = _NO_USAGE) -> bytes:
        """A chunk with these choices and `"usage": null`, or with `usage` (the totals on the last
        chunk, or the usage so far when the client asked for continuous usage) in its place."""
        tail = self._tail if usage is _NO_USAGE else b',"usage":' + _JSON.encode(usage).encode() + b"}\n\n"
        return self._head + _JSON.encode(choices).encode() + tail


class StreamChunks(Protocol):
    """A streamed response's SSE events, from a generation's outputs (`data: [DONE]` is the
    response's own). May raise: the stream then ends with an error event."""

    def feed(self, prompt_index: int, out: RequestOutput) -> list[bytes]:
        """The events one output adds."""
        ...

    def end(self) -> list[bytes]:
        """The events after the last output (the usage chunk, where asked)."""
        ...


def _body(data: bytes, more_body: bool = True) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more_body}


async def _run_rest(coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """Run a coroutine started by hand, now waiting on `waiting_on` (what it yielded: a future,
    or None for a bare yield), to its end, as a task would have."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:  # wait beside it (awaiting it here too would be a second await of one future)
                await asyncio.wait({waiting_on})
        except BaseException as e:  # this task was cancelled: pass it on into the coroutine
            try:
                waiting_on = coro.throw(e)
            except StopIteration:
                return
            continue
        try:
            waiting_on = coro.send(None)  # its own await of the future now returns (or raises)
        except StopIteration:
            return


class ChunkWriter:
    """A response body written from plain callbacks, in order. ASGI's `send` is a coroutine, yet
    neither uvicorn's nor the middleware's waits unless the connection is paused (the client reads
    slower than the engine writes), so it is run to its end right there, as Python 3.12's eager
    tasks would: no task per chunk. Where it does wait, it finishes on a task, and what is written
    meanwhile goes out after it as one write. `write(data, last=True)` ends the body in the same
    message (one socket write for the last bytes and the end of the chunked body); nothing may be
    written after it. A send that fails (the client went away) sets `failed`; later writes are
    dropped."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._queued: list[bytes] = []
        self._flushing: asyncio.Task[None] | None = None
        self._is_ended = False  # the last write is made (sent, or queued behind a waiting send)
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def write(self, data: bytes, last: bool = False) -> None:
        if self.failed.done() or self._is_ended:
            return
        self._is_ended = last
        if self._flushing is not None:
            self._queued.append(data)
            return
        sent = self._send(_body(data, not last))
        waiting_on = None
        if type(sent) is CoroutineType:  # (not the Coroutine ABC's isinstance: a token's cost)
            try:
                waiting_on = sent.send(None)
            except StopIteration:
                return
            except Exception as e:
                self._fail(e)
                return
        # The send waits (or is an awaitable of another kind): it finishes on a task.
        self._flushing = asyncio.ensure_future(self._flush(sent, waiting_on))

    async def _flush(self, sent: Awaitable[None], waiting_on: Any) -> None:
        try:
            if isinstance(sent, CoroutineType):
                await _run_rest(sent, waiting_on)
            else:
                await sent
            while self._queued and not self.failed.done():
                data = b"".join(self._queued)
                self._queued.clear()
                # Taken with the queue: the last write is always the last one queued.
                await self._send(_body(data, not self._is_ended))
        except Exception as e:
            self._fail(e)
        finally:
            self._flushing = None

    def _fail(self, error: Exception) -> None:
        if isinstance(error, OSError):  # the connection went
            access.log_for_request(logger, logging.DEBUG, "streamed write failed: %r", error)
        else:
            access.log_for_request(logger, logging.ERROR, "streamed write failed", exc_info=error)
        self._queued.clear()
        if not self.failed.done():
            self.failed.set_result(None)

    async def drain(self) -> None:
        """Until what was written has gone to the server (or the connection failed)."""
        while self._flushing is not None and not self._flushing.done():
            await asyncio.wait({self._flushing})

    def close(self) -> None:
        if self._flushing is not None:
            self._flushing.cancel()


class EngineStreamingResponse(Response):
    """A generation streamed as SSE events: each output through `chunks`, then `data: [DONE]`."""

    media_type = "text/event-stream"

    def __init__(self, run: GenerationRun, chunks: StreamChunks) -> None:
        # Not Response.__init__, which sets a body and with it a Content-Length of 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._run = run
        self._chunks = chunks

    def closing_events(self, error: BaseException | None) -> list[bytes]:
        """The stream's last events, after the last output's: an error event where it failed,
        then `data: [DONE]`."""
        return [DONE] if error is None else [sse(errors.error_payload(error)), DONE]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Set once the stream's end is written (after the last output, or an error).
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        writer = ChunkWriter(send)
        chunks = self._chunks
        # A one-prompt run's finished output is its last: its events wait for the end of the
        # stream, so the last token, the usage chunk, `[DONE]` and the end of the chunked body
        # leave in one socket write instead of four.
        held: list[bytes] = []
        is_one_prompt = self._run.num_prompts == 1

        def on_output(prompt_index: int, out: RequestOutput) -> None:
            if ended.done():
                return
            try:
                events = chunks.feed(prompt_index, out)
            except Exception as e:
                on_end(e)
                return
            if out.finished and is_one_prompt:
                held.extend(events)
            elif events:
                writer.write(events[0] if len(events) == 1 else b"".join(events))

        def on_end(error: BaseException | None) -> None:
            """Write the end of the stream: what was held, the closing events (the usage chunk
            where asked, or an error event), `[DONE]`, and the end of the body."""
            if ended.done():
                return
            tail = held
            if error is None:
                try:
                    tail.extend(chunks.end())
                except Exception as e:
                    error = e
            tail.extend(self.closing_events(error))
            writer.write(b"".join(tail), last=True)
            ended.set_result(None)

        async def pull() -> None:
            try:
                async for prompt_index, out in self._run.outputs():
                    on_output(prompt_index, out)
                    await writer.drain()  # a slow client holds the stream here, not in memory
            except Exception as e:
                on_end(e)
            on_end(None)

        watcher = asyncio.create_task(wait_for_disconnect(receive))
        tasks: set[asyncio.Future[Any]] = {watcher}
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            if not self._run.listen(on_output, on_end):
                tasks.add(asyncio.create_task(pull()))
            waits: set[asyncio.Future[Any]] = {ended, watcher, writer.failed}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():
                access.log_for_request(logger, logging.INFO, "client disconnected mid-stream")
                return
            await writer.drain()
        except OSError:  # the connection went while sending the start
            access.log_for_request(logger, logging.INFO, "client disconnected mid-stream")
        finally:
            writer.close()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            await self._run.close()
