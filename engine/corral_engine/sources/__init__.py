"""Model sources: hf://, s3://, pvc:// URIs and local paths resolved to a checkpoint directory through
the model cache (`resolve_model`); what `corral fetch-model` and `corral engine --model URI` share.
Light: no torch; the clients (huggingface_hub, boto3) load only when a source needs them, and the
names below load on first use, so the operator can import the pure `sources.uri` alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral_engine.sources.errors import KINDS, FetchError
    from corral_engine.sources.fetch import (
        FetchOptions,
        ResolvedModel,
        local_model_problem,
        parse,
        resolve_model,
    )
    from corral_engine.sources.uri import ModelUri, ModelUriError, parse_model_uri

_LAZY = {
    "KINDS": "corral_engine.sources.errors",
    "FetchError": "corral_engine.sources.errors",
    "FetchOptions": "corral_engine.sources.fetch",
    "ResolvedModel": "corral_engine.sources.fetch",
    "local_model_problem": "corral_engine.sources.fetch",
    "parse": "corral_engine.sources.fetch",
    "resolve_model": "corral_engine.sources.fetch",
    "ModelUri": "corral_engine.sources.uri",
    "ModelUriError": "corral_engine.sources.uri",
    "parse_model_uri": "corral_engine.sources.uri",
}

__all__ = [
    "KINDS",
    "FetchError",
    "FetchOptions",
    "ModelUri",
    "ModelUriError",
    "ResolvedModel",
    "local_model_problem",
    "parse",
    "parse_model_uri",
    "resolve_model",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'corral_engine.sources' has no attribute {name!r}")
