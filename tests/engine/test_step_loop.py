"""The step loop's inputs: a request another thread adds while the loop applies an abort of a queued
one is neither lost nor fatal (the loop once replaced its input queue under the adding thread: the
request vanished and its stream hung, or the loop died of a queue changed as it read it)."""

from __future__ import annotations

import queue
import threading
from typing import Any

from corral_engine.errors import InvalidRequestError
from corral_engine.outputs import EngineStats, RequestOutput
from corral_engine.step_loop import StepLoop

NUM_ADDED_WHILE_READ = 3


class _Server:
    """The server's thread: adds a request to the loop when asked, and answers once it has."""

    def __init__(self) -> None:
        self.loop: StepLoop | None = None
        self._asks: queue.Queue[_Request | None] = queue.Queue()
        self._done: queue.Queue[None] = queue.Queue()
        self.num_added = 0
        self._thread = threading.Thread(target=self._serve, name="test-server")
        self._thread.start()

    def _serve(self) -> None:
        while (request := self._asks.get()) is not None:
            assert self.loop is not None
            self.loop.add(request)
            self._done.put(None)

    def add_now(self, request: _Request) -> None:
        self.num_added += 1
        self._asks.put(request)
        self._done.get(timeout=10)

    def close(self) -> None:
        self._asks.put(None)
        self._thread.join(timeout=10)


class _Request:
    """A queued request whose id, each time the loop reads it, has the server add another one
    first (the first few times): an add that lands while the loop works through its queue."""

    def __init__(self, request_id: str, server: _Server) -> None:
        self._id, self._server = request_id, server

    @property
    def request_id(self) -> str:
        server = self._server
        if server.num_added < NUM_ADDED_WHILE_READ:
            server.add_now(_Request(f"added-{server.num_added}", server))
        return self._id


class _Engine:
    """Notes what the loop inserts; never has work to step."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.inserted: list[str] = []

    def insert_request(self, request: _Request) -> None:
        self.requests[request.request_id] = request
        self.inserted.append(request.request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.requests.pop(request_id, None)
        return None

    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats()


class _Sink:
    """Records what the loop reports; stops it once it goes idle."""

    def __init__(self) -> None:
        self.loop: StepLoop | None = None
        self.dropped_ids: list[str] = []
        self.deaths: list[BaseException] = []
        self.last_stats = EngineStats()

    def outputs(self, outputs: list[RequestOutput]) -> None:
        raise AssertionError(f"no request was running: {outputs}")

    def stepped(self, *_: Any) -> None:
        raise AssertionError("nothing to step")

    def stats(self, stats: EngineStats) -> None:
        self.last_stats = stats
        assert self.loop is not None
        self.loop.stop()

    def error(self, request_id: str, error: InvalidRequestError) -> None:
        raise AssertionError(f"{request_id}: {error}")

    def dropped(self, request_id: str) -> None:
        self.dropped_ids.append(request_id)

    def died(self, error: BaseException) -> None:
        self.deaths.append(error)


def test_a_request_added_while_an_abort_of_a_queued_one_is_applied_is_taken_in() -> None:
    engine, sink, server = _Engine(), _Sink(), _Server()
    loop = sink.loop = server.loop = StepLoop(engine, sink)  # type: ignore[arg-type]
    try:
        loop.add(_Request("aborted", server))  # type: ignore[arg-type]
        loop.add(_Request("kept", server))  # type: ignore[arg-type]
        loop.abort("aborted")  # while both are still queued
        loop.run()  # here: one pass over its inputs, then idle, when the sink stops it
    finally:
        server.close()
    assert sink.deaths == []
    added = [f"added-{i}" for i in range(NUM_ADDED_WHILE_READ)]
    assert sorted(engine.inserted) == sorted(["kept", *added])
    assert sink.dropped_ids == ["aborted"]
    # Every request handed over is counted taken: the front's admission accounting closes.
    assert sink.last_stats.num_requests_taken_total == 2 + NUM_ADDED_WHILE_READ
