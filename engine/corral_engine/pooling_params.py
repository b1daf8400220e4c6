"""A pooling (embedding) request's parameters: what `add_request` takes in place of SamplingParams
on an engine served with --runner pooling, as vLLM v1 does (light; no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """`dimensions`: keep the vector's first N values, then normalize again (matryoshka models
    only); `normalize`: scale to unit length (None: the model's pooler config decides)."""

    dimensions: int | None = None
    normalize: bool | None = None
