"""A simulated pooling model (--runner pooling): an embedding model or a classifier (a reranker,
a sequence or token classifier), the runner, pooler and labels read from the checkpoint's
config.json and sentence-transformers files as the engine reads them, and each request's output
deterministic pseudo-values drawn from its token ids (no model, no torch)."""

from __future__ import annotations

import hashlib
import math
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError
from corral_engine.pooling import (
    EmbedSpec,
    PoolerConfig,
    choose_runner,
    is_classifier_architecture,
    is_encoder_architecture,
    is_token_classifier_architecture,
    matryoshka_of,
    resolve_pooler,
)
from corral_engine.pooling_params import ClassifierActivation, PoolingParams
from corral_engine.sim.tokenizer import read_json_object

# transformers' num_labels where config.json names neither it nor id2label.
_DEFAULT_NUM_LABELS = 2


@dataclass(frozen=True, slots=True)
class SimPooling:
    """What a simulated pooling replica serves: the request checks' spec (vector size, matryoshka,
    a classifier's labels), the pooler's default normalization, and whether it is an encoder
    (prompts admitted whole)."""

    embed: EmbedSpec
    pooler: PoolerConfig
    is_encoder: bool = False

    def vector(self, token_ids: list[int], params: PoolingParams) -> list[float]:
        """The request's output, flat as the engine's (`finish_output`): a vector cut and
        normalized as asked, a classifier's activated scores, or the rows of a token task."""
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        size, labels = self.embed.embedding_size, self.embed.num_labels
        if params.task == "classify":
            return activated(pseudo_vector(token_ids, labels, False, None), params.activation)
        if params.task == "embed":
            return pseudo_vector(token_ids, size, normalize, params.dimensions)
        out: list[float] = []
        for position in range(len(token_ids)):  # a row a token, seeded by the ids and its place
            seed = [*token_ids, -1 - position]
            if params.task == "token_classify":
                out += activated(pseudo_vector(seed, labels, False, None), params.activation)
            else:
                out += pseudo_vector(seed, size, normalize, params.dimensions)
        return out


def pseudo_vector(token_ids: list[int], size: int, normalize: bool, dimensions: int | None) -> list[float]:
    """`size` values in [-1, 1) seeded by a hash of the token ids, so equal inputs get equal vectors
    on every replica and process; the first `dimensions` kept, then scaled to unit length when asked
    (the engine's order: a shortened vector is unit length too)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    vector = [rng.uniform(-1.0, 1.0) for _ in range(size if dimensions is None else dimensions)]
    if normalize:
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        vector = [v / norm for v in vector]
    return vector


def activated(logits: list[float], activation: ClassifierActivation) -> list[float]:
    """A classifier's logits activated as the engine's `classifier_scores` does: none as they are,
    a sigmoid each (one label, or "sigmoid"), else softmax over the labels."""
    if activation == "none":
        return logits
    if activation == "sigmoid" or len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-x)) for x in logits]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    return [e / sum(exps) for e in exps]


def sim_pooling(
    model_dir: Path, runner: str, pooler_config: str | None, model_name: str
) -> SimPooling | None:
    """The pooling a replica of `model_dir` serves under --runner `runner` (None: it generates), as
    the engine resolves it (`pooling_step.choose_runner_for`): auto picks pooling for an encoder or
    an embedding architecture; generate is refused (ModelLoadError) for an encoder or a base model."""
    config = read_json_object(model_dir / "config.json")
    architectures = [str(a) for a in config.get("architectures") or []]
    is_encoder = any(is_encoder_architecture(a) for a in architectures)
    is_classifier = is_encoder and any(is_classifier_architecture(a) for a in architectures)
    chosen = choose_runner(runner, architectures)
    if chosen == "generate":
        if is_encoder or choose_runner("auto", architectures) == "pooling":
            what = "an encoder" if is_encoder else "a base model without an LM head"
            serves = "scores" if is_classifier else "embeddings"
            raise ModelLoadError(f"{architectures[0]} is {what}: it serves {serves} only (--runner pooling)")
        return None
    size = config.get("hidden_size", (config.get("text_config") or {}).get("hidden_size"))
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: an embedding model needs hidden_size (its vectors' length)"
        )
    is_matryoshka, dimensions = matryoshka_of(config)
    pooler = resolve_pooler(model_dir, pooler_config, "CLS" if is_encoder else "LAST")
    heads = _classifier_fields(config, model_dir, architectures) if is_classifier else {}
    embed = EmbedSpec(model_name, "pooling", size, is_matryoshka, dimensions, is_encoder=is_encoder, **heads)
    return SimPooling(embed, pooler, is_encoder)


def _classifier_fields(config: dict[str, Any], model_dir: Path, architectures: list[str]) -> dict[str, Any]:
    """A classifier's num_labels, labels (id2label's, transformers' LABEL_i where it names none)
    and problem_type, and whether it labels each token, as the engine reads them."""
    where = model_dir / "config.json"
    id2label = config.get("id2label")
    if id2label is not None and not isinstance(id2label, dict):
        raise ModelLoadError(f"{where}: id2label must be an object")
    # transformers derives num_labels from id2label where config.json holds one (it always saves it).
    num_labels = len(id2label) if id2label else config.get("num_labels", _DEFAULT_NUM_LABELS)
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ModelLoadError(f"{where}: num_labels must be a positive integer, got {num_labels!r}")
    if id2label is None:
        labels: tuple[str | None, ...] = tuple(f"LABEL_{i}" for i in range(num_labels))
    else:
        named = {str(key): str(value) for key, value in id2label.items()}
        labels = tuple(named.get(str(i)) for i in range(num_labels))
    problem_type = config.get("problem_type")
    return {
        "num_labels": num_labels,
        "labels": labels,
        "problem_type": problem_type if isinstance(problem_type, str) else None,
        "is_token_classifier": any(is_token_classifier_architecture(a) for a in architectures),
    }
