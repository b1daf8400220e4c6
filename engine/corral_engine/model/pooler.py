"""Hidden states -> embeddings (--runner pooling): each sequence's rows pooled by last token, mean
or CLS, across prefill chunks, then truncated (matryoshka) and normalized; a cross-encoder's
logits -> its scores; per-token rows (vLLM's token tasks) finished row by row.

`Pooler.pool` takes hidden rows and per-sequence spans only, so any forward pass that yields
[T, hidden] rows feeds it: the paged causal decoder chunk by chunk, or an encoder's whole prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corral_engine.pooling import PoolingType
from corral_engine.pooling_params import ClassifierActivation, PoolingParams


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """One sequence's rows in a step's hidden states: rows [row_start, row_end) hold its positions
    from `start` on; `is_last` when they reach the end of its prompt (its vector is due)."""

    seq_id: int
    row_start: int
    row_end: int
    start: int
    is_last: bool


class Pooler:
    """Pools per sequence, keeping across steps what a chunked prompt needs: a running float32 sum
    (MEAN) or its first row (CLS). A chunk that starts at position 0 starts afresh (a sequence
    preempted and recomputed)."""

    def __init__(self, pooling_type: PoolingType) -> None:
        self.pooling_type = pooling_type
        self._partial: dict[int, torch.Tensor] = {}  # seq_id -> [hidden] float32 (sum or CLS row)
        self._num_rows: dict[int, int] = {}  # seq_id -> rows summed (MEAN)

    def pool(self, hidden: torch.Tensor, spans: list[PoolSpan]) -> dict[int, torch.Tensor]:
        """hidden [T, H] -> seq_id -> pooled [H] float32, for the spans that end their prompt."""
        done: dict[int, torch.Tensor] = {}
        for span in spans:
            rows = hidden[span.row_start : span.row_end]  # [n, H]
            if self.pooling_type == "LAST":
                if span.is_last:
                    done[span.seq_id] = rows[-1].float()
                continue
            if span.start == 0:
                self.release(span.seq_id)
            if self.pooling_type == "CLS":
                if span.start == 0:
                    self._partial[span.seq_id] = rows[0].float()
            else:
                total = rows.float().sum(dim=0)  # [H]
                before = self._partial.get(span.seq_id)
                self._partial[span.seq_id] = total if before is None else before + total
                self._num_rows[span.seq_id] = self._num_rows.get(span.seq_id, 0) + len(rows)
            if span.is_last:
                vector = self._partial.pop(span.seq_id)
                num_rows = self._num_rows.pop(span.seq_id, 1)
                done[span.seq_id] = vector / num_rows if self.pooling_type == "MEAN" else vector
        return done

    def release(self, seq_id: int) -> None:
        """Forget a sequence's partial pooling (finished, aborted, or starting again)."""
        self._partial.pop(seq_id, None)
        self._num_rows.pop(seq_id, None)


def finish_vector(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> list[float]:
    """The vector a client gets: its first `dimensions` values (matryoshka), normalized to unit
    length when asked (after the cut, so a shortened vector is unit length too)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = F.normalize(vector, p=2, dim=-1)  # each row of a per-token [n, H] on its own
    return [float(x) for x in vector.flatten().tolist()]


def finish_output(output: torch.Tensor, params: PoolingParams, default_normalize: bool) -> list[float]:
    """A runner's output for `params.task` as the client gets it, flat: a vector or a
    classifier's scores, or each token's row ([n, H] or [n, labels]) finished alike, concatenated.
    `default_normalize`: the model's pooler config's, where the request leaves it."""
    if params.task in ("classify", "token_classify"):  # the runner gave the classifier's logits
        return classifier_scores(output, params.activation)
    normalize = default_normalize if params.normalize is None else params.normalize
    return finish_vector(output, normalize, params.dimensions)


def classifier_scores(logits: torch.Tensor, activation: ClassifierActivation = "auto") -> list[float]:
    """A classifier's outputs as vLLM's score and classify and sentence-transformers' CrossEncoder
    give them ("auto": the sigmoid of a single label's logit, a relevance score in (0, 1), else
    softmax over labels); "sigmoid": each label's own; "none": the logits. logits [labels], or
    [n, labels] a token each (activated row by row, then flattened)."""
    if activation == "none":
        scores = logits
    elif activation == "sigmoid" or logits.shape[-1] == 1:
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    return [float(x) for x in scores.flatten().tolist()]
