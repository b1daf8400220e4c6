"""The model runner: picks device and dtype, loads weights, owns the KV cache, executes a step."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from corral_engine.args import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineArgs
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.errors import ModelLoadError
from corral_engine.model.attention import AttentionContext, DecodeBatch, SeqAttention
from corral_engine.model.config import ModelConfig
from corral_engine.model.llama import CausalLM, Linear, rope_parameters
from corral_engine.model.loader import load_weights
from corral_engine.model.native import load_paged_decode

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# bf16 matmuls of at least this many rows run in float32 where the CPU has no native bf16 (Linear).
# CORRAL_BF16_UPCAST: "auto" (default), "1" always (for tests), "0" never.
UPCAST_MIN_ROWS = 8
ENV_UPCAST = "CORRAL_BF16_UPCAST"
ENV_PREPACK = "CORRAL_PREPACK"


def select_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(requested)
    except RuntimeError as e:
        raise ModelLoadError(f"invalid device {requested!r}: {e}") from e


def cpu_supports_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def available_memory_bytes() -> int | None:
    """Memory the kernel could give this process now (MemAvailable), if it says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def select_dtype(requested: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cuda":
        if checkpoint_dtype in ("bfloat16", "float16"):
            return _DTYPES[checkpoint_dtype]
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


@dataclass(frozen=True, slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: AttentionContext
    logits_indices: torch.Tensor  # [S] rows of the batch whose next token is sampled


class ModelRunner:
    def __init__(self, config: ModelConfig, args: EngineArgs, max_model_len: int) -> None:
        self.config = config
        self.block_size = args.block_size
        # One padded, batched attention call for all single-token decodes
        # (CORRAL_BATCHED_DECODE=0 attends them one by one, for comparison).
        self.batched_decode = os.environ.get("CORRAL_BATCHED_DECODE", "1") != "0"
        self.device = select_device(args.device)
        self.dtype = select_dtype(args.dtype, self.device, config.torch_dtype)
        # The native paged decode kernel when it builds here (CPU, bf16/fp32); else PyTorch SDPA.
        kernel = load_paged_decode() if self.batched_decode and self.device.type == "cpu" else None
        self.decode_kernel = (
            kernel if kernel is not None and kernel.supports(self.dtype, self.device) else None
        )
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or max(1, len(os.sched_getaffinity(0))))
        self.model = self._build_model()
        self.num_kv_blocks = self._num_kv_blocks(args, max_model_len)
        self.block_rows = BlockTableRows(-(-max_model_len // self.block_size))
        shape = (self.num_kv_blocks, self.block_size, config.num_kv_heads, config.head_dim)
        # Zeroed, not empty: batched decode reads (masked) slots nobody wrote yet, and a NaN there
        # would survive masking (0 * NaN); stale finite values from freed blocks are harmless.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(config.num_layers)
        ]
        logger.info(
            "model %s on %s/%s: %d KV blocks of %d tokens",
            config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_kv_blocks,
            self.block_size,
        )

    def _build_model(self) -> CausalLM:
        with torch.device("meta"):
            model = CausalLM(self.config)
        model = model.to_empty(device=self.device).to(self.dtype)
        if self.config.tie_word_embeddings:  # moving off the meta device unties shared parameters
            model.lm_head.weight = model.model.embed_tokens.weight
        load_weights(model, self.config)
        self.upcast_rows = self._upcast_rows()
        prepack = self._prepack()
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        keep_copies = self._keep_upcast_copies(sum(m.weight.numel() for m in linears) * 4)
        for linear in linears:
            linear.upcast_min_rows = self.upcast_rows
            if keep_copies:
                linear.prepack_upcast()
            if prepack:
                is_shared = linear is model.lm_head and self.config.tie_word_embeddings
                try:
                    linear.prepack(keep_weight=is_shared)
                except RuntimeError as e:  # e.g. bf16 packing needs AVX512 or AVX-NE-CONVERT
                    logger.info("Linear weights stay unpacked: %s", e)
                    prepack = False
        if prepack:
            logger.info("Linear weights prepacked for oneDNN (%s)", str(self.dtype).removeprefix("torch."))
        inv_freq, _ = rope_parameters(self.config)
        model.rotary.inv_freq = inv_freq.to(self.device)  # float32 on purpose, as transformers keeps it
        return model.eval()

    def _prepack(self) -> bool:
        """Linear weights prepacked for oneDNN, by default on CPU in float32 (small preset, AVX2,
        same process A/B: 1.13-1.37x output tok/s at batch 64, 1.03-1.21x at batch 1, greedy output
        identical) and in bf16 where the CPU multiplies bf16 natively (AVX512-BF16 / AMX). The bf16
        default follows PyTorch's own compiler, which packs bf16 Linear weights on such CPUs because
        a plain-layout weight keeps oneDNN off its AMX kernel or reorders it on every call; vLLM's
        CPU build prepacks too. It is not yet measured on an AMX machine by this project
        (`bench/engine/prepack_ab.py --dtype bfloat16 --on auto` does). `CORRAL_PREPACK=1` packs
        whatever oneDNN can, `0` nothing."""
        mode = self._prepack_mode()
        if mode == "0":
            return False
        if self.dtype == torch.bfloat16 and self.upcast_rows:
            return False  # bf16 batches are multiplied in float32 here; packing would not apply
        if mode == "1" or self.dtype == torch.float32:
            return True
        return self.dtype == torch.bfloat16 and cpu_supports_bf16()

    def _prepack_mode(self) -> str:
        """CORRAL_PREPACK ("auto", "1" or "0"), or "0" where oneDNN cannot pack (not CPU, no oneDNN)."""
        if self.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return "0"
        return os.environ.get(ENV_PREPACK, "auto")

    def _keep_upcast_copies(self, copy_bytes: int) -> bool:
        """On CPUs without native bf16, where bf16 batches are multiplied in float32: keep a
        prepacked float32 copy of each Linear weight instead of converting it on every call (the
        conversion was 28% of a batch-64 step). `CORRAL_PREPACK=auto` does when the copies take at
        most a quarter of the memory available now; `1` always, `0` never."""
        mode = self._prepack_mode()
        if not self.upcast_rows or mode == "0":
            return False
        mib = copy_bytes // 2**20
        available = available_memory_bytes()
        if mode == "auto" and (available is None or copy_bytes > available // 4):
            logger.info("bf16 weights are converted per batch: a float32 copy (%d MiB) would not fit", mib)
            return False
        logger.info("bf16 Linear weights also kept in float32 for batches of %d+ rows (%d MiB)",
                    self.upcast_rows, mib)  # fmt: skip
        return True

    def _upcast_rows(self) -> int:
        mode = os.environ.get(ENV_UPCAST, "auto")
        if self.dtype != torch.bfloat16 or self.device.type != "cpu" or mode == "0":
            return 0
        if mode == "auto" and cpu_supports_bf16():
            return 0
        logger.info("bf16 matmuls of %d+ rows run in float32 (no native bf16 on this CPU)", UPCAST_MIN_ROWS)
        return UPCAST_MIN_ROWS

    def _num_kv_blocks(self, args: EngineArgs, max_model_len: int) -> int:
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        bytes_per_block = self.block_size * self.config.kv_bytes_per_token * self.dtype.itemsize
        if args.kv_cache_memory_bytes is not None:
            num = args.kv_cache_memory_bytes // bytes_per_block
            if num < 1:
                raise ModelLoadError(
                    f"kv cache memory {args.kv_cache_memory_bytes} bytes holds no block of "
                    f"{bytes_per_block} bytes; raise it"
                )
            return int(num)
        # Default: a fixed budget, but no more than twice what max_num_seqs full-length sequences
        # can use (the surplus keeps prefix-cache entries alive); small models stay small.
        useful = 2 * args.max_num_seqs * -(-max_model_len // self.block_size)
        return int(max(1, min(DEFAULT_KV_CACHE_MEMORY_BYTES // bytes_per_block, useful)))

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[SeqAttention] = []
        logits_indices: list[int] = []
        decode_rows: list[int] = []
        decode_table_rows: list[int] = []  # each decode row's sequence in self.block_rows
        decode_num_blocks: list[int] = []
        decode_lens: list[int] = []
        row = 0
        for s in scheduled:
            seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
            table = seq.block_table
            num_blocks = -(-end // bs)
            input_ids.extend(seq.token_ids[start : end - s.num_spec])
            if s.num_spec:
                input_ids.extend(seq.spec_token_ids[: s.num_spec])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if self.batched_decode and (s.num_new_tokens == 1 or s.num_spec):
                # A decode, or a decode with draft tokens to verify: each of those rows attends
                # like a decode over the context up to itself (its K/V is written first).
                table_row = self.block_rows.row(seq.seq_id, table)
                for j in range(s.num_new_tokens):
                    decode_rows.append(row + j)
                    decode_table_rows.append(table_row)
                    decode_num_blocks.append(-(-(start + j + 1) // bs))
                    decode_lens.append(start + j + 1)
            else:
                block_ids = torch.tensor(table[:num_blocks], dtype=torch.long, device=self.device)
                seqs.append(SeqAttention(row, row + s.num_new_tokens, end, block_ids))
            row += s.num_new_tokens
            if s.samples:  # the last real token's row, then one per draft token
                logits_indices.extend(range(row - 1 - s.num_spec, row))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        def tables(group: list[int]) -> torch.Tensor:
            width = max(decode_num_blocks[i] for i in group)
            rows = torch.tensor([decode_table_rows[i] for i in group], dtype=torch.long)
            return self.block_rows.table[rows, :width].to(self.device)

        decodes = [
            DecodeBatch(
                as_tensor([decode_rows[i] for i in group]),
                tables(group),
                as_tensor([decode_lens[i] for i in group]),
            )
            for group in self._decode_groups(decode_num_blocks)
        ]
        ctx = AttentionContext(as_tensor(slots), seqs, bs, decodes, self.decode_kernel)
        return StepBatch(as_tensor(input_ids), as_tensor(positions), ctx, as_tensor(logits_indices))

    def _decode_groups(self, num_blocks: list[int]) -> list[list[int]]:
        if not num_blocks:
            return []
        if self.decode_kernel is not None:  # reads each context at its own length: no padding
            return [list(range(len(num_blocks)))]
        return group_by_length(num_blocks)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; return float32 logits for the sequences that sample, in order: one row
        each, plus one per draft token of speculating sequences."""
        batch = self.prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.ctx)
        if batch.logits_indices.numel() == 0:
            return torch.empty((0, self.config.vocab_size))
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))


class BlockTableRows:
    """Running sequences' block tables kept as rows of one tensor across steps (vLLM v1 keeps a
    persistent batch the same way), so a decode step copies only the blocks added since the last
    step instead of converting every sequence's whole table: that work grew with context length
    (1.3 ms a step for 128 sequences of 2,048 tokens).

    A row is rewritten whole when its sequence's table is a new list object (the block manager
    replaces the list when it frees or adopts blocks, and only ever extends it in place otherwise);
    it holds a reference to the list it mirrors, so that identity check cannot be fooled by a
    reused address. Entries past a sequence's length are stale block ids, which readers mask."""

    def __init__(self, num_columns: int, num_rows: int = 64) -> None:
        self.table = torch.zeros((num_rows, max(1, num_columns)), dtype=torch.long)
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: dict[int, tuple[int, list[int], int]] = {}  # seq_id -> (row, mirrored, written)

    def row(self, seq_id: int, blocks: list[int]) -> int:
        """The row holding `blocks` (the sequence's block table) as of now."""
        entry = self._rows.get(seq_id)
        if entry is not None and entry[1] is blocks and entry[2] <= len(blocks):
            row, _, start = entry
        else:
            row, start = (entry[0] if entry is not None else self._take()), 0
        if len(blocks) > start:
            if len(blocks) > self.table.shape[1]:
                extra = torch.zeros(
                    (self.table.shape[0], len(blocks) - self.table.shape[1]), dtype=torch.long
                )
                self.table = torch.cat([self.table, extra], dim=1)
            self.table[row, start : len(blocks)] = torch.tensor(blocks[start:], dtype=torch.long)
        self._rows[seq_id] = (row, blocks, len(blocks))
        return row

    def release(self, seq_id: int) -> None:
        entry = self._rows.pop(seq_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def _take(self) -> int:
        if not self._free:
            grown = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        return self._free.pop()


def group_by_length(num_blocks: list[int], max_waste: float = 0.5, max_group: int = 64) -> list[list[int]]:
    """Indices of decoding sequences grouped so each group's padded width (its longest block table)
    is at most (1 + max_waste) x its shortest: mixed lengths must not pad every short context to
    the longest one (attention cost and the gather grow with the padded width)."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if (
            group is None
            or len(group) >= max_group
            or num_blocks[i] > (1 + max_waste) * max(1, num_blocks[group[0]])
        ):
            groups.append([i])
        else:
            group.append(i)
    return groups
