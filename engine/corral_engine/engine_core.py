"""The engine core in a process of its own (`CORRAL_ENGINE_PROCESS=1`), vLLM v1's layout.

In one process (`AsyncEngine`) the step thread and the server's event loop share the GIL: every
token a stream sends (JSON, SSE, a socket write, ~40 us of the event loop's CPU) is time the step
thread cannot run Python, and where a step is short (a GPU's few milliseconds) that is a large
share of it. Here the scheduler and the model run on the main thread of a child process (spawned,
so it starts clean of the parent's threads and OpenMP team), stepping whenever a request is
unfinished; the server's process keeps HTTP, tokenizing, request checks and streaming.

Between them, two one-way pipes of pickled tuples (`multiprocessing.connection`: length-prefixed
messages, no extra dependency):
- to the core: ("add", id, prompt token ids, SamplingParams or PoolingParams, arrival time,
  LoraRequest or None, the images as `multimodal.ImageInput`s: float32 pixel arrays, 12 KiB for a
  32x32 image, 1.3 MiB for LLaVA-1.5's 336x336), ("abort",
  id), ("add_lora", LoraRequest), ("remove_lora", lora id), ("stop",);
- from the core: ("ready", `CoreInfo`) or ("failed", kind, message) once at start, then per step
  ("step", outputs, duration_s, batched tokens, times to first token, inter-token gaps, stats),
  and ("out", outputs) for an aborted request's last output, ("stats", stats) when idle, ("error",
  id, message, param) for a request the core refused, ("dropped", id), ("lora_added", lora id,
  None or the error's message), ("dead", message), ("stopped",).
Outputs travel as plain tuples without their prompt token ids (the server's side has them), so a
step's message grows with the tokens it produced, not with the prompts.

The server checks each request itself before it is sent (prompt length, the KV cache's size, token
ids in the vocabulary, a grammar that compiles), so a bad one is still refused with its 400 at
once; the core checks again when it builds the request. Timestamps are `time.monotonic()`, one
clock for both processes on Linux. The core ignores SIGINT and SIGTERM (the server drains, then
stops it) and stops when its input pipe closes (the server died).

The child's main is in `core_process`, the messages' packing in `core_messages`; this module, the
server's side, imports no torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import logging
import multiprocessing
import multiprocessing.util
import pickle
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from corral_engine.args import EngineArgs
from corral_engine.core_messages import PROTOCOL, CoreInfo, unpack_outputs
from corral_engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.multimodal import ImageInput, check_images, prompt_of, with_images
from corral_engine.outputs import RequestOutput, StepLatencies
from corral_engine.pooling_params import PoolingParams
from corral_engine.request_checks import KvShape, check_pooling_prompt, check_request
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from corral_engine.stream_front import StreamFront

logger = logging.getLogger(__name__)


def _formatter_of(logger: logging.Logger) -> logging.Formatter | None:
    """The formatter of the logger's first handler, if it travels to another process (JSON lines
    stay JSON lines in the core's output)."""
    for handler in logger.handlers:
        if handler.formatter is not None:
            try:
                pickle.dumps(handler.formatter)
            except Exception:  # a formatter holding something unpicklable: the core logs text
                return None
            return handler.formatter
    return None


def _core_main(*args: Any) -> None:
    """The spawned child's entry. Its module is loaded by name, so the server's side never imports
    it, nor the engine and torch it imports (import-linter holds engine_core to that). The core
    ignores SIGINT and SIGTERM from the start, its imports included: the server drains, then
    stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    importlib.import_module("corral_engine.core_process").run_core(*args)


def _stop_core(to_core: Connection, from_core: Connection, process: BaseProcess) -> None:
    """Ask the core to stop and wait for its process (killed after 30 s: it ignores SIGTERM), then
    close both pipes. `from_core` stays open until the core is gone, so its last messages (a reader
    thread may still take them) never meet a closed pipe."""
    with contextlib.suppress(OSError):  # the core is gone already
        to_core.send_bytes(pickle.dumps(("stop",), protocol=PROTOCOL))
    to_core.close()
    process.join(30.0)
    if process.is_alive():
        logger.warning("the engine core did not stop in 30 s; killing it")
        process.kill()
        process.join(10.0)
    from_core.close()


# -- the server's side -----------------------------------------------------------------------------
class EngineCoreClient(StreamFront):
    """`AsyncEngine`'s interface with the engine core in a child process."""

    def __init__(self, args: EngineArgs, settings: EngineSettings | None = None) -> None:
        from corral_engine.tokenizer import load_tokenizer

        super().__init__(args.max_num_seqs)
        self.args = args
        context = multiprocessing.get_context("spawn")
        root = logging.getLogger()
        core_inbox, self._to_core = context.Pipe(duplex=False)
        self._from_core, core_outbox = context.Pipe(duplex=False)
        # Not a daemon: a tensor-parallel core starts rank processes of its own.
        self._process = context.Process(
            target=_core_main,
            args=(args, settings, core_inbox, core_outbox, root.getEffectiveLevel(), _formatter_of(root)),
            name="corral-engine-core",
        )
        self._process.start()
        core_inbox.close()
        core_outbox.close()
        # Stops the core at shutdown(), when the client is collected, or at exit when it was left
        # running: multiprocessing runs this before it waits for its non-daemonic children, and the
        # core, waiting for requests, would never end on its own.
        self._stop_core = multiprocessing.util.Finalize(
            self, _stop_core, args=(self._to_core, self._from_core, self._process), exitpriority=10
        )
        info = self._wait_ready()
        self.tokenizer: Any = load_tokenizer(args.model)
        self.served_model_name = info.served_model_name
        self.max_model_len = info.max_model_len
        self.eos_token_ids = info.eos_token_ids
        self._vocab_size = info.vocab_size
        self._kv = KvShape(info.num_kv_blocks, info.block_size)
        self._stats = info.stats
        self.embed = info.embed
        self.runner = info.embed.runner  # generate, or pooling (embeddings)
        self.embedding_size = info.embed.embedding_size  # the vectors' length; 0 when generating
        # A vision model's ImageProcessor (the server builds a chat's images with it); images cross
        # the pipe as pixels.
        self.images: Any = None
        if info.vision is not None:
            from corral_engine.image_processor import ImageProcessor

            self.images = ImageProcessor(
                args.model, info.vision, args.max_images_per_prompt, args.allowed_media_domains
            )
        self._grammars: Any = None  # a GrammarCompiler, built at the first constrained request
        self._prompts: dict[str, list[int]] = {}  # request id -> prompt ids, until its final output
        self._send_lock = threading.Lock()
        self._lora_replies: dict[int, concurrent.futures.Future[str | None]] = {}  # by lora id
        self._reader: threading.Thread | None = None
        # Called (on the reader thread) with the reason when the core's process exits unasked, after
        # the open streams were failed: a replica without its core cannot serve (`corral engine`
        # exits, for its supervisor to restart it, as it does when a tensor-parallel rank dies).
        self.on_core_exit: Callable[[str], None] | None = None

    def _wait_ready(self) -> CoreInfo:
        while not self._from_core.poll(0.5):
            if not self._process.is_alive():
                code = self._process.exitcode
                raise RuntimeError(f"the engine core exited with code {code} while starting")
        message = pickle.loads(self._from_core.recv_bytes())
        if message[0] == "ready":
            info: CoreInfo = message[1]
            return info
        self._process.join(30.0)
        if message[1] == "model":
            raise ModelLoadError(message[2])
        raise RuntimeError(f"the engine core failed to start: {message[2]}")

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._reader = threading.Thread(target=self._read, name="corral-core-outputs", daemon=True)
        self._reader.start()

    async def shutdown(self) -> None:
        """Stop the core's process and end every open stream; idempotent."""
        self._running = False
        with contextlib.suppress(EngineDeadError):
            self._send(("stop",))
        if self._reader is not None:  # it returns once the core says it stopped
            await asyncio.to_thread(self._reader.join, 30.0)
            self._reader = None
        await asyncio.to_thread(self._stop_core)  # waits for the process, closes the pipes
        self.end_open_streams(EngineDeadError("the engine is shutting down"))

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        *,
        in_group: bool = False,
        lora: LoraRequest | None = None,
        mm_inputs: tuple[ImageInput, ...] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As `AsyncEngine.add_request`: checked here, at once, then sent to the core (a prompt's
        images processed here, or as given in `mm_inputs`; their pixel values pickled onto the pipe)."""
        self._check_admission(request_id, None if in_group else self.args.max_waiting)
        token_ids, mm_inputs = self._check(prompt, params, mm_inputs)
        self._prompts[request_id] = token_ids  # before the core can answer
        self._num_handed += 1  # before the core can report it taken
        try:
            self._send(("add", request_id, token_ids, params, time.monotonic(), lora, mm_inputs))
        except EngineDeadError:
            del self._prompts[request_id]
            self._num_handed -= 1
            raise
        # Its outputs reach the streams through this event loop, so after this returns.
        return self._streams.open(request_id, self.abort)

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead core holds nothing to free
            self._send(("abort", request_id))

    async def add_lora(self, lora: LoraRequest) -> None:
        """Have the core read and register an adapter; AdapterError with its reason if it cannot."""
        done: concurrent.futures.Future[str | None] = concurrent.futures.Future()
        self._lora_replies[lora.lora_id] = done
        try:
            self._send(("add_lora", lora))
            problem = await asyncio.wrap_future(done)
        finally:
            self._lora_replies.pop(lora.lora_id, None)
        if problem is not None:
            raise AdapterError(problem)

    def remove_lora(self, lora_id: int) -> None:
        with contextlib.suppress(EngineDeadError):
            self._send(("remove_lora", lora_id))

    def _check(
        self, prompt: Any, params: SamplingParams | PoolingParams, given: tuple[ImageInput, ...] | None
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """What `LLMEngine.make_request` refuses, refused here (the core builds the request)."""
        self.embed.check(params)
        text_or_ids = prompt_of(prompt)
        if isinstance(text_or_ids, str):
            token_ids = list(self.tokenizer.encode(text_or_ids, add_special_tokens=True))
        else:
            token_ids = list(text_or_ids)
        if given is None:
            token_ids, mm_inputs = with_images(prompt, token_ids, self.images, self.served_model_name)
        else:
            mm_inputs = given
        check_images(token_ids, mm_inputs, self.images, self.served_model_name)
        if isinstance(params, PoolingParams):
            check_pooling_prompt(token_ids, self.max_model_len, self._vocab_size, self._kv)
            return token_ids, mm_inputs
        check_request(token_ids, params, self.max_model_len, self._vocab_size, self._kv)
        if params.grammar is not None:
            if self._grammars is None:
                from corral_engine.structured.compiler import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self._vocab_size, self.eos_token_ids)
            self._grammars.matcher(params.grammar)  # InvalidRequestError where it does not compile
        return token_ids, mm_inputs

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=PROTOCOL)
        try:
            with self._send_lock:
                self._to_core.send_bytes(data)
        except OSError as e:
            raise EngineDeadError("the engine core is gone") from e

    # -- the reader thread ----------------------------------------------------------------------
    def _read(self) -> None:
        conn = self._from_core
        failure: str | None = None  # the core reported its loop dead: its process ends next
        try:
            while True:
                message = pickle.loads(conn.recv_bytes())
                kind = message[0]
                if kind == "step":
                    self._step_done(
                        unpack_outputs(message[1], self._prompts),
                        message[2],
                        message[3],
                        StepLatencies(message[4], message[5]),
                        message[6],
                    )
                elif kind == "out":
                    self._deliver(unpack_outputs(message[1], self._prompts))
                elif kind == "stats":
                    self._stats = message[1]
                elif kind == "error":
                    _, request_id, text, param = message
                    self._prompts.pop(request_id, None)
                    self._deliver_error(request_id, InvalidRequestError(text, param))
                elif kind == "dropped":
                    self._prompts.pop(message[1], None)
                    self._deliver_dropped(message[1])
                elif kind == "lora_added":
                    reply = self._lora_replies.get(message[1])
                    if reply is not None and not reply.done():
                        reply.set_result(message[2])
                elif kind == "dead":
                    failure = f"the engine failed: {message[1]}"
                    self._die(failure)
                elif kind == "stopped":
                    if failure is None:
                        return
                    break
        except (EOFError, OSError):
            if not self._running:
                return
            self._process.join(1.0)
            if failure is None:
                failure = f"the engine core exited (code {self._process.exitcode})"
                self._die(failure)
        # The core is gone either way (a dead loop ends its process, and a dead tensor-parallel rank
        # may end it before or after the loop reports): the same exit whichever came first.
        if self._running and self.on_core_exit is not None:
            self.on_core_exit(failure)

    def _die(self, reason: str) -> None:
        logger.error("%s", reason)
        self._dead = EngineDeadError(reason)
        self._fail_all(self._dead)
        for reply in list(self._lora_replies.values()):
            if not reply.done():
                reply.set_exception(self._dead)
