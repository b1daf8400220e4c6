"""The engine core's process: the spawned child's main (`run_core`), which loads the engine, steps
it and pickles each step's results onto the pipe to the server. The protocol and the server's side
are in `engine_core`, the messages' packing in `core_messages`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from corral_engine.args import EngineArgs
from corral_engine.core_messages import PROTOCOL, CoreInfo, pack_outputs
from corral_engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.outputs import EngineStats, RequestOutput, StepLatencies
from corral_engine.settings import EngineSettings
from corral_engine.step_loop import StepLoop

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _PipeSink:
    """The step loop's results, pickled onto the pipe to the server (from the step thread and the
    input thread, hence the lock)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._last_stats: EngineStats | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=PROTOCOL)
        with self._lock:
            self._conn.send_bytes(data)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        self.send(("out", pack_outputs(outputs)))

    def stepped(
        self,
        outputs: list[RequestOutput],
        duration_s: float,
        num_tokens: int,
        latencies: StepLatencies,
        stats: EngineStats,
    ) -> None:
        self._last_stats = stats
        self.send(
            ("step", pack_outputs(outputs), duration_s, num_tokens, latencies.ttft_s, latencies.itl_s, stats)
        )

    def stats(self, stats: EngineStats) -> None:
        if stats != self._last_stats:
            self._last_stats = stats
            self.send(("stats", stats))

    def error(self, request_id: str, error: InvalidRequestError) -> None:
        self.send(("error", request_id, str(error), error.param))

    def dropped(self, request_id: str) -> None:
        self.send(("dropped", request_id))

    def died(self, error: BaseException) -> None:
        self.send(("dead", f"{type(error).__name__}: {error}"))


def _set_threads(args: EngineArgs) -> None:
    import torch

    # As `corral engine` does in one process: tensor-parallel ranks on one machine share its cores.
    torch.set_num_threads(
        args.num_threads or max(1, len(os.sched_getaffinity(0)) // args.tensor_parallel_size)
    )
    with contextlib.suppress(RuntimeError):  # parallel work already started: harmless
        torch.set_num_interop_threads(1)


def run_core(
    args: EngineArgs,
    settings: EngineSettings | None,
    inbox: Connection,
    outbox: Connection,
    log_level: int,
    log_formatter: logging.Formatter | None = None,
) -> None:
    """The child's main (signals already ignored): load, say hello, then step until told to stop or
    the server is gone."""
    handler = logging.StreamHandler(sys.stderr)  # the server's format (`--log-format`), else text
    handler.setFormatter(log_formatter or logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=log_level, handlers=[handler])
    sink = _PipeSink(outbox)
    _set_threads(args)
    try:
        engine = LLMEngine(args, settings)
    except ModelLoadError as e:
        sink.send(("failed", "model", str(e)))
        return
    except BaseException as e:
        logger.exception("the engine core failed to start")
        sink.send(("failed", "other", f"{type(e).__name__}: {e}"))
        return
    if hasattr(engine.runner, "on_failure"):  # tensor parallel: a dead rank ends the core
        engine.runner.on_failure = _exit_on_rank_failure
    gc.collect()
    gc.freeze()  # the loaded engine's objects never become garbage: full passes skip them
    loop = StepLoop(engine, sink)
    stats = engine.stats()
    info = CoreInfo(
        engine.served_model_name,
        engine.max_model_len,
        tuple(engine.eos_token_ids),
        engine.model_config.vocab_size,
        engine.block_manager.num_blocks,
        engine.block_manager.block_size,
        stats,
        engine.embed,
        engine.model_config.vision,
    )
    sink.send(("ready", info))

    def take_inputs() -> None:
        while True:
            try:
                message = pickle.loads(inbox.recv_bytes())
            except (EOFError, OSError):  # the server is gone
                loop.stop()
                return
            kind = message[0]
            if kind == "add":
                _, request_id, token_ids, params, arrival_time, lora, mm_inputs = message
                try:
                    request = engine.make_request(
                        request_id, token_ids, params, arrival_time, lora, mm_inputs
                    )
                    loop.add(request)
                except InvalidRequestError as e:
                    loop.refused()  # the server counted it as handed over
                    sink.error(request_id, e)
            elif kind == "abort":
                loop.abort(message[1])
            elif kind == "add_lora":
                sink.send(("lora_added", message[1].lora_id, _add_lora(engine, message[1])))
            elif kind == "remove_lora":
                engine.remove_lora(message[1])
            elif kind == "stop":
                loop.stop()
                return

    threading.Thread(target=take_inputs, name="corral-core-inputs", daemon=True).start()
    loop.run()
    engine.close()
    sink.send(("stopped",))


def _add_lora(engine: LLMEngine, lora: LoraRequest) -> str | None:
    """Register an adapter on the input thread (reading it does not hold up the steps); None, or
    why it cannot be served."""
    try:
        engine.add_lora(lora)
    except (AdapterError, EngineDeadError) as e:
        return str(e)
    return None


def _exit_on_rank_failure(message: str) -> None:
    logger.error("%s; the engine core exits", message)
    logging.shutdown()
    os._exit(1)
