"""LoRA adapters in the model: PEFT weights read and checked against the base model (`lora_weights`),
kept in host memory, and copied into `max_loras` device slots that the forward pass applies to the
rows of a mixed batch (each target linear: y += scale * (x @ A^T) @ B^T for the rows of each active
slot).

Each target Linear gets a `LoraLayer` (stacked A [slots, R, in] and B [slots, out, R] per
checkpoint projection; R = max_lora_rank, a smaller rank zero-padded), its forward wrapped on the
instance. A step with no adapter active leaves `LoraSlots.groups` empty and each layer returns its
output untouched; an engine without --enable-lora wraps nothing. Slots are float32 where the base
multiplies bf16 in float32 (a CPU without native bf16), else of the model's dtype.

Host memory holds at most `max_cpu_loras` adapters' weights, least recently used dropped first; a
dropped one is read again from its path when a request needs it (`stage`).

Under tensor parallelism each rank reads its shard of every adapter, cut as the base weight is
(ShardPlan.checkpoint_slice): a column-parallel projection's B rows (a fused one's, Phi-3's, the
rank's rows of each part), a row-parallel one's A columns. A row-parallel delta is then a partial
sum, completed by the layer's own all-reduce.

An adapter targets the modules of its base's transformers model (lora.base_targets): Phi-3's
fused qkv_proj / gate_up_proj, one A and B over the whole fused Linear; the others' split
projections, each on its columns of the fused Linear. An adapter naming the other kind is
refused, as vLLM refuses modules its model lacks.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.lora import AdapterConfig, AdapterError, LoraRequest, base_targets
from corral_engine.model.llama import CausalLM
from corral_engine.model.lora_weights import HOLDERS, AdapterReader, AdapterWeights, Tensors
from corral_engine.model.matmul_plan import MatmulPlan
from corral_engine.settings import Switch

logger = logging.getLogger(__name__)


class LoraLayer:
    """The adapters of one Linear: per projection it holds, its output columns and stacked weights."""

    def __init__(self, slots: LoraSlots, in_features: int, parts: dict[str, tuple[int, int]]) -> None:
        self.slots = slots
        self.in_features = in_features
        self.parts = parts  # projection -> (first output column, columns)
        n, r, dtype, device = slots.max_loras, slots.max_rank, slots.dtype, slots.device
        self.a = {p: torch.zeros((n, r, in_features), dtype=dtype, device=device) for p in parts}
        self.b = {p: torch.zeros((n, size, r), dtype=dtype, device=device) for p, (_, size) in parts.items()}

    def wrap(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The Linear's forward with this layer's deltas added in steps that run an adapter. Set
        on the instance only with --enable-lora, so an engine without it runs Linear unchanged."""
        slots = self.slots

        def forward_with_lora(x: torch.Tensor) -> torch.Tensor:
            out = forward(x)
            return self.add(x, out) if slots.groups else out

        return forward_with_lora

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out ([T, out]) plus each active slot's delta on its rows of x ([T, in]), computed in
        the slots' dtype and rounded to out's, as the base's upcast rounds its product."""
        for slot, rows, scale in self.slots.groups:
            xs = x.index_select(0, rows).to(self.slots.dtype)  # [n, in]
            for part, (offset, size) in self.parts.items():
                delta = (xs @ self.a[part][slot].T) @ self.b[part][slot].T  # [n, size]
                out[:, offset : offset + size].index_add_(0, rows, delta.to(out.dtype), alpha=scale)
        return out


class LoraSlots:
    """Registered adapters (host) and the `max_loras` device slots the forward pass reads."""

    def __init__(
        self,
        model: CausalLM,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,  # the slots' (float32 where the base upcasts bf16), not the model's
        device: torch.device,
        max_cpu_loras: int | None = None,  # adapters' weights kept in host memory; None: max_loras
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.dtype, self.device = dtype, device
        self.adapters: dict[int, AdapterWeights] = {}  # registered ones, by lora id
        # Ids whose weights are in host memory, least recently used first; the lock orders the
        # input thread's adds (reading a new adapter) with the step thread's uses.
        self._host: OrderedDict[int, None] = OrderedDict()
        self._host_lock = threading.Lock()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recent first
        self._free = list(range(max_loras - 1, -1, -1))
        # The step's active slots: (slot, its rows of the batch [n] on the device, scale).
        self.groups: list[tuple[int, torch.Tensor, float]] = []
        self.targets = base_targets(model.config.architecture)  # the modules adapters may name
        self.layers: dict[tuple[int, str], LoraLayer] = {}  # (layer, projection) -> its LoraLayer
        for i, layer in enumerate(model.model.layers):
            for module_name, linear_name in dict.fromkeys(HOLDERS.values()):
                linear = getattr(getattr(layer, module_name), linear_name)
                offsets = getattr(linear, "shard_offsets", None)
                if offsets is None or linear_name in self.targets:  # targeted whole, by its own name
                    offsets = {linear_name: (0, linear.out_features)}
                lora_layer = LoraLayer(self, linear.in_features, offsets)
                linear.forward = lora_layer.wrap(linear.forward)  # type: ignore[method-assign]
                for part in offsets:
                    self.layers[(i, part)] = lora_layer
        plan = None if model.tp is None else model.tp.plan  # this rank's shard, or None: whole
        self._reader = AdapterReader(model.config, plan, self.targets, self.layers, max_rank, dtype)

    # -- adapters -------------------------------------------------------------------------------
    def add(self, lora: LoraRequest) -> None:
        """Read, check and register an adapter (raises AdapterError)."""
        if lora.lora_id in self.adapters:
            raise AdapterError(f"adapter {lora.name!r} is already loaded")
        weights = self.read(lora)
        with self._host_lock:
            self.adapters[lora.lora_id] = weights
            self._keep(lora.lora_id)
        logger.info("LoRA adapter %r (id %d) registered from %s", lora.name, lora.lora_id, lora.path)

    def remove(self, lora_id: int) -> None:
        with self._host_lock:
            self.adapters.pop(lora_id, None)
            self._host.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._free.append(slot)

    def stage(self, lora_id: int) -> Tensors | None:
        """Make a registered adapter ready to run: its weights, read again from its path when
        the host cache dropped them, or None when it sits in a device slot and needs none.
        Raises AdapterError when it is not registered or can no longer be read."""
        weights = self.adapters.get(lora_id)
        if weights is None:
            raise AdapterError(f"adapter id {lora_id} is not loaded")
        with self._host_lock:
            tensors = weights.tensors
            if tensors is not None:
                self._keep(lora_id)
                return tensors
        if lora_id in self._slot_of:
            return None
        tensors = self.read(weights.lora).tensors  # outside the lock: it reads files
        logger.info("LoRA adapter %r read again from %s", weights.lora.name, weights.lora.path)
        with self._host_lock:
            if lora_id in self.adapters:  # not removed meanwhile
                weights.tensors = tensors
                self._keep(lora_id)
        return tensors

    def _keep(self, lora_id: int) -> None:
        """Mark `lora_id`'s weights most recently used; drop the least recently used weights
        beyond max_cpu_loras (under `_host_lock`)."""
        self._host[lora_id] = None
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            dropped, _ = self._host.popitem(last=False)
            self.adapters[dropped].tensors = None
            logger.debug("LoRA adapter id %d dropped from host memory (least recently used)", dropped)

    @property
    def in_host_memory(self) -> list[int]:
        """Ids of the adapters whose weights are in host memory, least recently used first."""
        return list(self._host)

    def read(self, lora: LoraRequest) -> AdapterWeights:
        return self._reader.read(lora)

    # -- a step ---------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]) -> None:
        """Set `groups` for this step's batch (rows in `scheduled` order), loading any adapter
        not in a slot into a free one, or into the least recently used slot no row needs. Slots
        depend only on the steps, adds and removes, so every tensor-parallel rank picks the same."""
        rows: dict[int, list[int]] = {}
        row = 0
        for s in scheduled:
            lora_id = s.lora_id()  # a worker's mirrored chunk carries rank 0's
            if lora_id is not None:
                rows.setdefault(lora_id, []).extend(range(row, row + s.num_new_tokens))
            row += s.num_new_tokens
        if not rows:
            self.groups = []
            return
        groups = []
        for lora_id, ids in rows.items():
            slot = self._slot(lora_id, rows)
            scale = self.adapters[lora_id].config.scale
            groups.append((slot, torch.tensor(ids, dtype=torch.long).to(self.device), scale))
        self.groups = groups

    def _slot(self, lora_id: int, needed: dict[int, list[int]]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            with self._host_lock:
                if lora_id in self._host:  # a use of its host copy too
                    self._keep(lora_id)
            return slot
        tensors = self.stage(lora_id)
        if tensors is None:  # not in a slot, so stage() returned its weights
            raise AdapterError(f"adapter id {lora_id} has no weights")
        weights = self.adapters[lora_id]
        if self._free:
            slot = self._free.pop()
        else:  # the scheduler runs at most max_loras adapters a step, so one is idle
            victim = next(i for i in self._slot_of if i not in needed)
            slot = self._slot_of.pop(victim)
        self._load(slot, weights.config, tensors)
        self._slot_of[lora_id] = slot
        return slot

    def _load(self, slot: int, config: AdapterConfig, tensors: Tensors) -> None:
        rank = config.rank
        for lora_layer in dict.fromkeys(self.layers.values()):
            for part in lora_layer.parts:
                lora_layer.a[part][slot].zero_()
                lora_layer.b[part][slot].zero_()
        for (layer, part), (a, b) in tensors.items():
            lora_layer = self.layers[(layer, part)]
            lora_layer.a[part][slot, :rank].copy_(a)
            lora_layer.b[part][slot, :, :rank].copy_(b)


_Stack = TypeVar("_Stack")
_Graphs = TypeVar("_Graphs")


def fast_paths(
    has_adapter_rows: bool, stack: _Stack, graphs: _Graphs
) -> tuple[_Stack | None, _Graphs | None]:
    """The native decode stack and the decode graphs a step may take: those built, unless a
    row of it runs an adapter (both compute the base model alone: no Linear wrapper runs)."""
    return (None, None) if has_adapter_rows else (stack, graphs)


def lora_slot_dtype(dtype: torch.dtype, plan: MatmulPlan, mode: Switch = "auto") -> torch.dtype:
    """The adapter slots' dtype: float32 where the base multiplies bf16 in float32 (`auto`,
    a CPU without native bf16, whose emulated bf16 matmul is the slow one), or with "1" for
    any bf16 model; else (and with "0") the model's dtype."""
    if dtype != torch.bfloat16 or mode == "0":
        return dtype
    return torch.float32 if mode == "1" or plan.upcast_min_rows else dtype
