"""The runner of an encoder-only model (BERT, RoBERTa, XLM-RoBERTa; --runner pooling): each scheduled
prompt whole in one forward pass, attended both ways, pooled (or a cross-encoder's classifier
applied), or each token's row kept (vLLM's per-token tasks); no KV cache, no sampling."""

from __future__ import annotations

import logging
import math

import torch

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.model.config import ModelConfig
from corral_engine.model.device import probe_cpu, select_device, select_dtype
from corral_engine.model.encoder import SequenceClassifier, TokenClassifier
from corral_engine.model.encoder_loader import load_encoder
from corral_engine.model.pooler import Pooler, PoolSpan
from corral_engine.pooling_params import PoolingParams, PoolingTask

logger = logging.getLogger(__name__)


class EncoderRunner:
    """Used by LLMEngine's pooling step like a ModelRunner. Its blocks are admission tokens only:
    a prompt's blocks bound how many tokens a step holds and are freed when its vector is out
    (the same step); they stand for no memory."""

    fills_inputs_on_device = False

    def __init__(self, config: ModelConfig, args: EngineArgs, max_model_len: int) -> None:
        self.device = select_device(args.device)
        self.dtype = select_dtype(args.dtype, self.device, config.torch_dtype, probe_cpu())
        _, self.model = load_encoder(config.path, self.dtype, self.device, config.encoder)
        # A step's prompts whole: its token budget (at least one longest prompt) plus a part-filled
        # last block for each sequence.
        budget = max(args.max_num_batched_tokens, max_model_len)
        self.num_kv_blocks = math.ceil(budget / args.block_size) + args.max_num_seqs
        self.on_failure = None  # one process, no ranks to watch
        logger.info(
            "encoder %s on %s in %s (no KV cache; prompts run whole)",
            config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
        )

    @torch.inference_mode()
    def pool(self, scheduled: list[ScheduledSeq], pooler: Pooler) -> dict[int, torch.Tensor]:
        """Each scheduled prompt's pooled last hidden state ([H] float32), or a classifier's logits
        ([num_labels] float32, from its first token), or per-token ones ([n, H] or [n, num_labels]
        for the token tasks), by seq id; the scheduler gives an encoder's prompts whole
        (SchedulerConfig.can_chunk_prompts)."""
        if not scheduled:
            return {}
        ids: list[int] = []
        types: list[int] = []
        seq_lens: list[int] = []
        spans: list[PoolSpan] = []
        for s in scheduled:
            request = s.seq.request
            prompt = request.prompt_token_ids
            if s.start != 0 or s.num_new_tokens != len(prompt):
                raise RuntimeError(f"an encoder runs whole prompts, not {s.start}+{s.num_new_tokens}")
            spans.append(PoolSpan(s.seq.seq_id, len(ids), len(ids) + len(prompt), 0, True))
            ids.extend(prompt)
            seq_lens.append(len(prompt))
            types.extend(_token_types(request.pooling, len(prompt), self.model.config.type_vocab_size))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        token_types = torch.tensor(types, dtype=torch.long, device=self.device) if any(types) else None
        hidden = self.model(input_ids, seq_lens, token_types)  # [T, H]
        tasks = [_task(s.seq.request.pooling) for s in scheduled]
        return self._outputs(hidden, spans, tasks, pooler)

    def _outputs(
        self, hidden: torch.Tensor, spans: list[PoolSpan], tasks: list[PoolingTask], pooler: Pooler
    ) -> dict[int, torch.Tensor]:
        """hidden [T, H] -> each span's output for its task (EmbedSpec.check saw the model serves it)."""
        classifier = self.model.classifier
        out = pooler.pool(hidden, [span for span, task in zip(spans, tasks, strict=True) if task == "embed"])
        firsts = [span for span, task in zip(spans, tasks, strict=True) if task == "classify"]
        if firsts and isinstance(classifier, SequenceClassifier):
            logits = classifier(hidden[[span.row_start for span in firsts]]).float()  # [S, labels]
            out.update((span.seq_id, row) for span, row in zip(firsts, logits, strict=True))
        for span, task in zip(spans, tasks, strict=True):
            rows = hidden[span.row_start : span.row_end]  # [n, H], a view
            if task == "token_embed":
                out[span.seq_id] = rows.float()
            elif task == "token_classify" and isinstance(classifier, TokenClassifier):
                out[span.seq_id] = classifier(rows).float()  # [n, labels]
        return out

    def execute(self, scheduled: list[ScheduledSeq], fill: object = None) -> torch.Tensor:
        """Never called: an encoder engine's steps pool (LLMEngine routes them to `pool`)."""
        raise RuntimeError("an encoder embedding model computes no logits")

    def release(self, seq_id: int) -> None:
        """Nothing is kept for a sequence across steps."""

    def add_lora(self, lora: LoraRequest) -> None:
        raise AdapterError("an encoder embedding model takes no LoRA adapters")

    def stage_lora(self, lora_id: int) -> None:
        """No adapter is ever added."""

    def remove_lora(self, lora_id: int) -> None:
        """No adapter is ever added."""

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]


def _task(params: PoolingParams | None) -> PoolingTask:
    return "embed" if params is None else params.task


def _token_types(params: PoolingParams | None, num_tokens: int, type_vocab_size: int) -> list[int]:
    """A prompt's token type ids: 1 from its pair's second segment on, where the model has a
    second type (RoBERTa and XLM-RoBERTa have one: all 0, as their tokenizers give)."""
    start = None if params is None else params.second_segment_start
    if start is None or type_vocab_size < 2:
        return [0] * num_tokens
    start = min(max(start, 0), num_tokens)
    return [0] * start + [1] * (num_tokens - start)
