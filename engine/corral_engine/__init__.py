"""Corral's bundled inference engine: paged KV cache, continuous batching, prefix caching.

Importing this package does not import torch; the heavy names below load on first use, so the
gateway and operator can import the light contract modules (`args`, `wire`) cheaply.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from corral_engine.args import EngineArgs
from corral_engine.outputs import CompletionOutput, EngineStats, RequestOutput
from corral_engine.pooling_params import PoolingParams
from corral_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from corral_engine.async_engine import AsyncEngine
    from corral_engine.engine_core import EngineCoreClient
    from corral_engine.llm_engine import LLMEngine

_LAZY = {
    "LLMEngine": "corral_engine.llm_engine",
    "AsyncEngine": "corral_engine.async_engine",
    "EngineCoreClient": "corral_engine.engine_core",
}

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineCoreClient",
    "EngineStats",
    "LLMEngine",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'corral_engine' has no attribute {name!r}")
