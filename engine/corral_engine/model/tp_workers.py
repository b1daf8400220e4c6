"""Tensor-parallel ranks as processes. Rank 0 runs in the engine's process: it schedules, sends
each step's inputs down a pipe to every other rank, and runs its own shard of the step; all ranks
meet in the model's collectives (model/parallel.py), and rank 0 alone gets the logits.

LoRA adapters go down the same pipes, in order with the steps: each worker reads its own shard
of an adapter and answers whether it took it, so every rank holds the same adapters and, seeing the
same steps, puts them in the same slots.

A rank that dies ends the group: the collectives of the others fail at once (its sockets close),
rank 0 names the dead rank in the error, and a watchdog thread calls `on_failure` even when no step
is running. Workers exit when rank 0 says stop or its pipe closes (rank 0 gone), so none outlives it.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.errors import EngineDeadError, ModelLoadError
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.model.batch import TokenFill
from corral_engine.model.config import ModelConfig, load_model_config
from corral_engine.model.cuda_graphs import GraphCapture
from corral_engine.model.device import select_device
from corral_engine.model.encoder_runner import EncoderRunner
from corral_engine.model.parallel import ShardPlan, TensorParallel, make_group
from corral_engine.model.runner import ModelRunner
from corral_engine.model.step_mirror import SequenceMirror, StepSeq, encode_step
from corral_engine.settings import EngineSettings

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 5.0
_DEATH_WAIT_S = 2.0  # how long a failed collective waits for the watchdog to name the dead rank
_START_POLL_S = 0.1  # how often start-up looks for a dead rank while rank 0 builds its shard


def rank_device(device: str, rank: int) -> torch.device:
    chosen = select_device(device)
    return torch.device("cuda", rank) if chosen.type == "cuda" else chosen


def make_runner(
    config: ModelConfig,
    args: EngineArgs,
    max_model_len: int,
    settings: EngineSettings,
    graph_capture: GraphCapture | None = None,
) -> ModelRunner | ParallelRunner | EncoderRunner:
    """The engine's runner: one ModelRunner, or rank 0 of --tensor-parallel-size ranks; an encoder
    embedding model's EncoderRunner (one rank: pooling refuses tensor parallelism)."""
    if config.encoder is not None:
        return EncoderRunner(config, args, max_model_len)
    if args.tensor_parallel_size == 1:
        return ModelRunner(config, args, max_model_len, settings, graph_capture=graph_capture)
    return ParallelRunner(config, args, max_model_len, settings)


class ParallelRunner:
    """Rank 0's runner plus the processes of ranks 1..N-1; used by LLMEngine like a ModelRunner."""

    fills_inputs_on_device = False  # the other ranks build their inputs from the host lists

    def __init__(
        self,
        config: ModelConfig,
        args: EngineArgs,
        max_model_len: int,
        settings: EngineSettings,
    ) -> None:
        size = args.tensor_parallel_size
        plan = ShardPlan.build(config, 0, size)  # a model the ranks cannot split fails here, at once
        device = rank_device(args.device, 0)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ModelLoadError(
                f"--tensor-parallel-size {size} needs {size} GPUs, one a rank; "
                f"this machine has {torch.cuda.device_count()}"
            )
        # Called on the watchdog thread with the error when a rank dies (`corral engine` exits).
        self.on_failure: Callable[[str], None] | None = None
        self.failure: str | None = None
        self._failed = threading.Event()  # set once `failure` names the dead rank
        self._closing = False
        self._released: list[int] = []
        self._send_lock = threading.Lock()  # adapters are added from other threads than the steps
        self._lora_lock = threading.Lock()  # one adapter added at a time: its answers are read in turn
        self._store_dir = tempfile.TemporaryDirectory(prefix="corral-tp-")
        store = Path(self._store_dir.name) / "store"
        ctx = multiprocessing.get_context("spawn")
        self.workers: list[Any] = []
        self._pipes: list[multiprocessing.connection.Connection] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()  # duplex: a worker answers each adapter it is sent
            worker = ctx.Process(
                target=run_worker,
                args=(args, settings, max_model_len, rank, store, theirs),
                name=f"corral-tp-rank{rank}",
                daemon=True,  # terminated at the engine's exit, whatever path it takes
            )
            worker.start()
            theirs.close()
            self.workers.append(worker)
            self._pipes.append(ours)
        self._watchdog = threading.Thread(target=self._watch, name="corral-tp-watchdog", daemon=True)
        self._watchdog.start()

        def build() -> ModelRunner:
            tp = TensorParallel(plan, make_group(store, 0, size, device), device)
            return ModelRunner(config, args, max_model_len, settings, tp=tp)

        try:
            self.local = self._start(build)
        except RuntimeError as e:  # the group did not form, or a rank died while loading
            self._wait_for_death()
            self.close()
            raise ModelLoadError(self.failure or f"tensor-parallel start-up failed: {e}") from e
        except BaseException:
            self.close()
            raise
        self.num_kv_blocks = self.local.num_kv_blocks
        self.device = self.local.device
        self.batches = self.local.batches
        self.model = self.local.model
        logger.info("tensor parallel: %d ranks (worker pids %s)", size, [w.pid for w in self.workers])

    def _start(self, build: Callable[[], ModelRunner]) -> ModelRunner:
        """Rank 0's group and shard, built on a thread of its own: a rank that dies first (before
        the ranks meet, or under a collective that would wait out its timeout) fails start-up as
        soon as the watchdog sees it, not minutes later when the wait times out."""
        built: list[ModelRunner] = []
        raised: list[BaseException] = []

        def run() -> None:
            try:
                built.append(build())
            except BaseException as e:  # handed to the caller below (or dropped: start-up failed)
                raised.append(e)

        # A daemon: a thread stuck in a wait that cannot be interrupted must not hold up the exit.
        thread = threading.Thread(target=run, name="corral-tp-start", daemon=True)
        thread.start()
        while thread.is_alive() and not self._failed.is_set():
            thread.join(_START_POLL_S)
        if self._failed.is_set():
            raise ModelLoadError(self.failure or "a tensor-parallel rank died during start-up")
        if raised:
            raise raised[0]
        return built[0]

    def execute(self, scheduled: list[ScheduledSeq], fill: TokenFill | None = None) -> torch.Tensor:
        if fill is not None:
            raise ValueError("tensor parallelism builds every rank's inputs on the host: no TokenFill")
        message = ("step", self._released, encode_step(scheduled))
        self._released = []
        self._send(message)
        try:
            return self.local.execute(scheduled)
        except (OSError, RuntimeError) as e:
            self._wait_for_death()
            raise EngineDeadError(self.failure or f"tensor-parallel step failed: {e}") from e

    def release(self, seq_id: int) -> None:
        self.local.release(seq_id)
        self._released.append(seq_id)

    def add_lora(self, lora: LoraRequest) -> None:
        """Every rank reads its shard of the adapter. If any refuses it, the ranks that took it
        drop it (all keep the same adapters) and the first refusal, rank 0's or else the lowest
        worker's, is raised as an AdapterError."""
        with self._lora_lock:
            self._send(("add_lora", lora))
            refused: dict[int, str] = {}
            try:
                self.local.add_lora(lora)
            except AdapterError as e:
                refused[0] = str(e)
            for rank, pipe in enumerate(self._pipes, start=1):
                answer = self._answer(rank, pipe)
                if answer is not None:
                    refused[rank] = answer
            if not refused:
                return
            if 0 not in refused:
                self.local.remove_lora(lora.lora_id)
            took = [pipe for rank, pipe in enumerate(self._pipes, start=1) if rank not in refused]
            self._send(("remove_lora", lora.lora_id), took)  # it never had a slot: no step ran it
            raise AdapterError(refused[min(refused)])

    def stage_lora(self, lora_id: int) -> None:
        """Rank 0 reads a dropped adapter again (the refusal, if any, is its); the other ranks
        read their shards again when a step loads it into a slot."""
        self.local.stage_lora(lora_id)

    def remove_lora(self, lora_id: int) -> None:
        """Drop the adapter on every rank, between the same two steps (the slots stay alike)."""
        self.local.remove_lora(lora_id)
        self._send(("remove_lora", lora_id))

    def _send(
        self, message: object, pipes: list[multiprocessing.connection.Connection] | None = None
    ) -> None:
        if self.failure is not None or self._closing:
            raise EngineDeadError(self.failure or "the engine is closed")
        data = pickle.dumps(message)
        try:
            with self._send_lock:
                for pipe in self._pipes if pipes is None else pipes:
                    pipe.send_bytes(data)
        except OSError as e:
            self._wait_for_death()
            raise EngineDeadError(self.failure or f"a tensor-parallel rank's pipe failed: {e}") from e

    def _answer(self, rank: int, pipe: multiprocessing.connection.Connection) -> str | None:
        """Worker `rank`'s answer to an adapter sent to it: None (taken) or why it refused."""
        try:
            while not pipe.poll(_START_POLL_S):  # a rank that dies while reading is seen here
                if self._failed.is_set():
                    raise EngineDeadError(self.failure or f"tensor-parallel rank {rank} died")
            return cast(str | None, pipe.recv())
        except (EOFError, OSError) as e:
            self._wait_for_death()
            raise EngineDeadError(self.failure or f"tensor-parallel rank {rank} is gone: {e}") from e

    def close(self) -> None:
        """Stop every worker (asked first, then terminated) and free rank 0's shard, idempotently."""
        self._closing = True
        for pipe in self._pipes:
            try:
                pipe.send_bytes(pickle.dumps(None))
                pipe.close()
            except OSError:
                pass  # that worker is gone already
        for worker in self.workers:
            worker.join(_STOP_WAIT_S)
            if worker.is_alive():
                worker.terminate()
                worker.join(_STOP_WAIT_S)
        self._pipes = []
        self._store_dir.cleanup()
        if hasattr(self, "local"):  # not when start-up failed
            self.local.close()
        if hasattr(self, "model"):
            del self.model

    def _watch(self) -> None:
        live = {w.sentinel: (rank, w) for rank, w in enumerate(self.workers, start=1)}
        while live:
            for sentinel in multiprocessing.connection.wait(list(live)):
                rank, worker = live.pop(cast(int, sentinel))
                if self._closing:
                    continue
                worker.join()
                self.failure = (
                    f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code "
                    f"{worker.exitcode}; the engine cannot run without it"
                )
                self._failed.set()
                logger.error("%s", self.failure)
                self._closing = True
                for other in self.workers:
                    if other.is_alive():
                        other.terminate()
                self._store_dir.cleanup()  # `on_failure` may end the process without close()
                if self.on_failure is not None:
                    self.on_failure(self.failure)

    def _wait_for_death(self) -> None:
        """A collective or a pipe failed: give the watchdog a moment to name the rank that died."""
        self._failed.wait(_DEATH_WAIT_S)


def run_worker(
    args: EngineArgs,
    settings: EngineSettings,
    max_model_len: int,
    rank: int,
    store: Path,
    pipe: multiprocessing.connection.Connection,
) -> None:
    """A worker process: build rank `rank`'s shard, then run every step rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_model_config(args.model)
        device = rank_device(args.device, rank)
        plan = ShardPlan.build(config, rank, args.tensor_parallel_size)
        tp = TensorParallel(plan, make_group(store, rank, args.tensor_parallel_size, device), device)
        _serve(ModelRunner(config, args, max_model_len, settings, tp=tp), pipe)
    finally:
        # Rank 0 removes the rendezvous directory when it closes; when it was killed, the workers
        # do on their way out (the ranks met long ago, or start-up has failed anyway).
        shutil.rmtree(store.parent, ignore_errors=True)


def _serve(runner: ModelRunner, pipe: multiprocessing.connection.Connection) -> None:
    """Run every step (and adapter change) rank 0 sends, until it says stop or is gone."""
    mirror = SequenceMirror()
    while True:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except EOFError:
            return  # rank 0 is gone
        if message is None:
            return
        if message[0] == "add_lora":
            pipe.send(_add_lora(runner, message[1]))
        elif message[0] == "remove_lora":
            runner.remove_lora(message[1])
        else:
            _step(runner, mirror, *message[1:])


def _step(runner: ModelRunner, mirror: SequenceMirror, released: list[int], steps: list[StepSeq]) -> None:
    for seq_id in released:
        mirror.release(seq_id)
        runner.release(seq_id)
    try:
        runner.execute(mirror.scheduled(steps))
    except RuntimeError as e:  # a collective failed: another rank is gone
        logger.error("step failed, leaving the group: %s", e)
        raise SystemExit(1) from e


def _add_lora(runner: ModelRunner, lora: LoraRequest) -> str | None:
    """This rank's shard of the adapter read and registered: None, or why it was refused."""
    try:
        runner.add_lora(lora)
    except AdapterError as e:
        return str(e)
    return None
