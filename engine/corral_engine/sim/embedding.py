"""A simulated embedding model (--runner pooling): the runner and pooler read from the checkpoint's
config.json and sentence-transformers files as the engine reads them, and each request's vector a
deterministic pseudo-vector drawn from its token ids (no model, no torch)."""

from __future__ import annotations

import hashlib
import math
import random
import struct
from dataclasses import dataclass
from pathlib import Path

from corral_engine.errors import ModelLoadError
from corral_engine.pooling import (
    EmbedSpec,
    PoolerConfig,
    choose_runner,
    is_classifier_architecture,
    is_encoder_architecture,
    matryoshka_of,
    resolve_pooler,
)
from corral_engine.pooling_params import PoolingParams
from corral_engine.sim.tokenizer import read_json_object


@dataclass(frozen=True, slots=True)
class SimPooling:
    """What a simulated pooling replica serves: the request checks' spec (vector size, matryoshka),
    the pooler's default normalization, and whether it is an encoder (prompts admitted whole)."""

    embed: EmbedSpec
    pooler: PoolerConfig
    is_encoder: bool = False

    def vector(self, token_ids: list[int], params: PoolingParams) -> list[float]:
        """The request's vector: `pseudo_vector` of its ids, cut and normalized as asked."""
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return pseudo_vector(token_ids, self.embed.embedding_size, normalize, params.dimensions)


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


def sim_pooling(
    model_dir: Path, runner: str, pooler_config: str | None, model_name: str
) -> SimPooling | None:
    """The pooling a replica of `model_dir` serves under --runner `runner` (None: it generates), as
    the engine resolves it (`pooling_step.choose_runner_for`): auto picks pooling for an encoder or
    an embedding architecture; generate is refused (ModelLoadError) for an encoder or a base model."""
    config = read_json_object(model_dir / "config.json")
    architectures = [str(a) for a in config.get("architectures") or []]
    if any(is_classifier_architecture(a) for a in architectures):
        raise ModelLoadError(
            f"{architectures[0]} is a reranker (a cross-encoder): the simulator does not serve "
            "/v1/score or /v1/rerank yet"
        )
    is_encoder = any(is_encoder_architecture(a) for a in architectures)
    chosen = choose_runner(runner, architectures)
    if chosen == "generate":
        if is_encoder or choose_runner("auto", architectures) == "pooling":
            what = "an encoder" if is_encoder else "a base model without an LM head"
            raise ModelLoadError(
                f"{architectures[0]} is {what}: it serves embeddings only (--runner pooling)"
            )
        return None
    size = config.get("hidden_size", (config.get("text_config") or {}).get("hidden_size"))
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: an embedding model needs hidden_size (its vectors' length)"
        )
    is_matryoshka, dimensions = matryoshka_of(config)
    pooler = resolve_pooler(model_dir, pooler_config, "CLS" if is_encoder else "LAST")
    return SimPooling(EmbedSpec(model_name, "pooling", size, is_matryoshka, dimensions), pooler, is_encoder)
