"""Tensor-parallel ranks as processes. Rank 0 runs in the engine's process: it schedules, sends
each step's inputs down a pipe to every other rank, and runs its own shard of the step; all ranks
meet in the model's collectives (model/parallel.py), and rank 0 alone gets the logits.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.core.sequence import Request, Sequence
from corral_engine.errors import EngineDeadError, ModelLoadError
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.model.batch import TokenFill
from corral_engine.model.config import ModelConfig, load_model_config
from corral_engine.model.cuda_graphs import GraphCapture
from corral_engine.model.device import select_device
from corral_engine.model.parallel import ShardPlan, TensorParallel, make_group
from corral_engine.model.runner import ModelRunner
from corral_engine.settings import EngineSettings

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 5.0
_DEATH_WAIT_S = 2.0  # how long a failed collective waits for the watchdog to name the dead rank
_START_POLL_S = 0.1  # how often start-up looks for a dead rank while rank 0 builds its shard


@dataclass(frozen=True, slots=True)
class StepSeq:
    """What another rank needs of one scheduled sequence to build the same batch."""

    seq_id: int
    start: int
    num_new_tokens: int
    num_spec: int
    samples: bool
    tokens: list[int]  # the chunk's tokens, drafts last
    block_table: list[int]
    prompt_positions: range  # positions whose logits score prompt tokens (prompt_logprobs)


@dataclass(slots=True)
class MirroredSeq(ScheduledSeq):
    """A scheduled chunk on a worker: its prompt-logprob positions come from rank 0 (the request's
    parameters stay there)."""

    positions: range = range(0)

    def prompt_positions(self) -> range:
        return self.positions


def encode_step(scheduled: list[ScheduledSeq]) -> list[StepSeq]:
    out = []
    for s in scheduled:
        seq, end = s.seq, s.start + s.num_new_tokens
        tokens = seq.token_ids[s.start : end - s.num_spec] + seq.spec_token_ids[: s.num_spec]
        positions = s.prompt_positions()
        args = (s.start, s.num_new_tokens, s.num_spec, s.samples, tokens, seq.block_table, positions)
        out.append(StepSeq(seq.seq_id, *args))
    return out


class SequenceMirror:
    """A worker's stand-ins for rank 0's sequences: the same ids, block tables and new tokens, so
    its BatchBuilder makes the same batch (block-table lists are extended in place, as the block
    manager does, so the persistent table rows are only appended to)."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def scheduled(self, steps: list[StepSeq]) -> list[ScheduledSeq]:
        out: list[ScheduledSeq] = []
        for st in steps:
            seq = self.seqs.get(st.seq_id)
            if seq is None:
                seq = Sequence(st.seq_id, cast(Request, None), 0, [], 0)
                self.seqs[st.seq_id] = seq
            table = seq.block_table
            if len(table) <= len(st.block_table) and st.block_table[: len(table)] == table:
                table.extend(st.block_table[len(table) :])
            else:
                seq.block_table = list(st.block_table)
            real = st.num_new_tokens - st.num_spec
            tokens = seq.token_ids
            del tokens[st.start :]
            tokens.extend([0] * (st.start - len(tokens)))  # positions this rank never saw (cached)
            tokens.extend(st.tokens[:real])
            if not st.samples:
                tokens.append(0)  # a prompt chunk short of the end: more tokens follow, none sampled
            seq.spec_token_ids = st.tokens[real:]
            out.append(MirroredSeq(seq, st.start, st.num_new_tokens, st.num_spec, st.prompt_positions))
        return out

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)


def rank_device(device: str, rank: int) -> torch.device:
    chosen = select_device(device)
    return torch.device("cuda", rank) if chosen.type == "cuda" else chosen


def make_runner(
    config: ModelConfig,
    args: EngineArgs,
    max_model_len: int,
    settings: EngineSettings,
    graph_capture: GraphCapture | None = None,
) -> ModelRunner | ParallelRunner:
    """The engine's runner: one ModelRunner, or rank 0 of --tensor-parallel-size ranks."""
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
        self._store_dir = tempfile.TemporaryDirectory(prefix="corral-tp-")
        store = Path(self._store_dir.name) / "store"
        ctx = multiprocessing.get_context("spawn")
        self.workers: list[Any] = []
        self._pipes: list[multiprocessing.connection.Connection] = []
        for rank in range(1, size):
            recv, send = ctx.Pipe(duplex=False)
            worker = ctx.Process(
                target=run_worker,
                args=(args, settings, max_model_len, rank, store, recv),
                name=f"corral-tp-rank{rank}",
                daemon=True,  # terminated at the engine's exit, whatever path it takes
            )
            worker.start()
            recv.close()
            self.workers.append(worker)
            self._pipes.append(send)
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
        if self.failure is not None or self._closing:
            raise EngineDeadError(self.failure or "the engine is closed")
        message = pickle.dumps((self._released, encode_step(scheduled)))
        self._released = []
        try:
            for pipe in self._pipes:
                pipe.send_bytes(message)
            return self.local.execute(scheduled)
        except (OSError, RuntimeError) as e:
            self._wait_for_death()
            raise EngineDeadError(self.failure or f"tensor-parallel step failed: {e}") from e

    def release(self, seq_id: int) -> None:
        self.local.release(seq_id)
        self._released.append(seq_id)

    def add_lora(self, lora: LoraRequest) -> None:
        """EngineArgs refuses LoRA with tensor parallelism; an adapter cannot get here."""
        raise AdapterError(f"adapter {lora.name!r}: LoRA is not supported with tensor parallelism")

    def remove_lora(self, lora_id: int) -> None:
        """Nothing to remove: no adapter is ever registered here."""

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
        _serve(args, settings, max_model_len, rank, store, pipe)
    finally:
        # Rank 0 removes the rendezvous directory when it closes; when it was killed, the workers
        # do on their way out (the ranks met long ago, or start-up has failed anyway).
        shutil.rmtree(store.parent, ignore_errors=True)


def _serve(
    args: EngineArgs,
    settings: EngineSettings,
    max_model_len: int,
    rank: int,
    store: Path,
    pipe: multiprocessing.connection.Connection,
) -> None:
    config = load_model_config(args.model)
    device = rank_device(args.device, rank)
    plan = ShardPlan.build(config, rank, args.tensor_parallel_size)
    tp = TensorParallel(plan, make_group(store, rank, args.tensor_parallel_size, device), device)
    runner = ModelRunner(config, args, max_model_len, settings, tp=tp)
    mirror = SequenceMirror()
    while True:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except EOFError:
            return  # rank 0 is gone
        if message is None:
            return
        released, steps = message
        for seq_id in released:
            mirror.release(seq_id)
            runner.release(seq_id)
        try:
            runner.execute(mirror.scheduled(steps))
        except RuntimeError as e:  # a collective failed: another rank is gone
            logger.error("step failed, leaving the group: %s", e)
            raise SystemExit(1) from e
