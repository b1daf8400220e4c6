"""Server-Sent Events as OpenAI sends them, and a streaming response that always cleans up.

The response watches the client's connection itself (whatever ASGI spec the server speaks), and
on any exit closes the body iterator and runs `on_close`, which aborts unfinished engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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


class EngineStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        watcher = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if stream not in done:
                logger.info("client disconnected mid-stream")
        finally:
            for task in (stream, watcher):
                task.cancel()
            for task in (stream, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._on_close()
