"""The BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa) over ragged batches: token embeddings to
last hidden states, each sequence attending to all of its own tokens and no other's (no KV cache);
and the sequence-classification head of a cross-encoder (reranker) on each sequence's first token,
or a token classifier's head on every token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from corral_engine.model.encoder_config import EncoderConfig

# Largest attention score tensor (sequences x heads x query x key elements) one padded group of
# sequences may make; longer batches are split into several groups (256 MiB of float32 scores).
_MAX_SCORE_ELEMENTS = 1 << 26


class Encoder(nn.Module):
    """Embeddings (word + position + token type, LayerNorm), then post-LN transformer layers; a
    classifier checkpoint's head in `classifier` (None for an embedding model)."""

    classifier: SequenceClassifier | TokenClassifier | None

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        if not config.num_labels:
            self.classifier = None
        elif config.is_token_classifier:
            self.classifier = TokenClassifier(config)
        else:
            self.classifier = SequenceClassifier(config)

    def forward(self, input_ids: Tensor, seq_lens: list[int], token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids [T] (the sequences concatenated, unpadded), seq_lens their lengths, each token's
        type [T] (None: all 0, one sentence per input) -> [T, H]."""
        positions = self.positions(seq_lens, input_ids.device)  # [T]
        if positions.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"seq_lens add up to {positions.shape[0]} tokens, input_ids has {input_ids.shape[0]}"
            )
        if token_type_ids is None:  # added in transformers' order: word, token type, position
            x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]  # [T, H]
        else:
            x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)  # [T, H]
        x = x + self.position_embeddings(positions)  # [T, H]
        x = self.embed_norm(x)  # [T, H]
        groups = attention_groups(seq_lens, self.config.num_heads, input_ids.device)
        for layer in self.layers:
            x = layer(x, groups)  # [T, H]
        return x

    def positions(self, seq_lens: list[int], device: torch.device) -> Tensor:
        """Each token's position id [T]: its index in its sequence plus the config's offset."""
        if any(n < 1 for n in seq_lens):
            raise ValueError(f"every sequence needs at least one token, got lengths {seq_lens}")
        longest = max(seq_lens, default=0)
        if longest > self.config.max_model_len:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds max_model_len {self.config.max_model_len}"
            )
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)  # [S]
        starts = torch.cumsum(lens, 0) - lens  # [S]
        total = int(sum(seq_lens))
        index = torch.arange(total, device=device) - torch.repeat_interleave(starts, lens)  # [T]
        return index + self.config.position_offset  # [T]


class SequenceClassifier(nn.Module):
    """A cross-encoder's head on a sequence's first token: dense + tanh, then `num_labels` logits.
    BERT's pooler then classifier, and RoBERTa's classifier.dense then out_proj, are this math
    (their dropouts are off at inference)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first_rows: Tensor) -> Tensor:
        """first_rows [S, H] (each sequence's first token's hidden state) -> logits [S, num_labels]."""
        return self.out(torch.tanh(self.dense(first_rows)))


class TokenClassifier(nn.Module):
    """A token classifier's head (BertForTokenClassification and kin): `num_labels` logits from
    each token's hidden state (the dropout before it is off at inference)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.out = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, rows: Tensor) -> Tensor:
        """rows [T, H] -> logits [T, num_labels]."""
        return self.out(rows)


class EncoderLayer(nn.Module):
    """Self-attention with biases, residual, LayerNorm; GELU feed-forward, residual, LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(h, 3 * h)  # query, key, value rows in this order
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(h, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        # transformers' gelu is the exact (erf) one; gelu_new and gelu_pytorch_tanh the tanh form.
        self.gelu_approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: Tensor, groups: list[AttentionGroup]) -> Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, nh, hd]
        attn = ragged_attention(q, k, v, groups).reshape(t, -1)  # [T, H]
        x = self.attn_norm(x + self.attn_out(attn))  # [T, H]
        inner = F.gelu(self.ffn_in(x), approximate=self.gelu_approximate)  # [T, I]
        return self.ffn_norm(x + self.ffn_out(inner))  # [T, H]


class AttentionGroup:
    """Sequences attended together, padded to the longest: `index` [B, L] each padded slot's
    token (0 for padding), `valid` [B, L] the real slots, `mask` [B, 1, 1, L] or None when no
    slot is padding."""

    __slots__ = ("index", "mask", "valid")

    def __init__(self, index: Tensor, valid: Tensor, mask: Tensor | None) -> None:
        self.index, self.valid, self.mask = index, valid, mask


def attention_groups(seq_lens: list[int], num_heads: int, device: torch.device) -> list[AttentionGroup]:
    """Sequences by length into groups whose padded scores stay under _MAX_SCORE_ELEMENTS (at
    least one sequence each); computed once per forward, shared by every layer."""
    starts, offset = [], 0
    for n in seq_lens:
        starts.append(offset)
        offset += n
    order = sorted(range(len(seq_lens)), key=lambda i: seq_lens[i])  # shortest first: little padding
    groups: list[list[int]] = []
    for i in order:
        longest = seq_lens[i]  # the longest so far: `order` is ascending
        if groups and (len(groups[-1]) + 1) * num_heads * longest * longest <= _MAX_SCORE_ELEMENTS:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for members in groups:
        lens = torch.tensor([seq_lens[i] for i in members], device=device)  # [B]
        first = torch.tensor([starts[i] for i in members], device=device)  # [B]
        slots = torch.arange(int(lens.max()), device=device)  # [L]
        valid = slots[None, :] < lens[:, None]  # [B, L]
        index = torch.where(valid, first[:, None] + slots[None, :], 0)  # [B, L]
        same_length = seq_lens[members[0]] == seq_lens[members[-1]]
        out.append(AttentionGroup(index, valid, None if same_length else valid[:, None, None, :]))
    return out


def ragged_attention(q: Tensor, k: Tensor, v: Tensor, groups: list[AttentionGroup]) -> Tensor:
    """Bidirectional attention of each sequence over its own tokens: q, k, v [T, nh, hd] -> [T, nh, hd]."""
    out = torch.empty_like(q)  # [T, nh, hd]; every token is in exactly one group
    for group in groups:
        qg = q[group.index].transpose(1, 2)  # [B, nh, L, hd]
        kg = k[group.index].transpose(1, 2)  # [B, nh, L, hd]
        vg = v[group.index].transpose(1, 2)  # [B, nh, L, hd]
        # Padding keys are masked out; padding queries compute rows nobody reads.
        attn = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=group.mask)  # [B, nh, L, hd]
        out[group.index[group.valid]] = attn.transpose(1, 2)[group.valid]  # [N, nh, hd]
    return out
