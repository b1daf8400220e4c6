"""Model sources: hf://, s3://, pvc:// URIs and local paths resolved to a checkpoint directory through
the model cache (`resolve_model`); what `corral fetch-model` and `corral engine --model URI` share.
Light: no torch; the clients (huggingface_hub, boto3) load only when a source needs them."""

from corral_engine.sources.errors import KINDS, FetchError
from corral_engine.sources.fetch import FetchOptions, ResolvedModel, parse, resolve_model
from corral_engine.sources.uri import ModelUri, ModelUriError, parse_model_uri

__all__ = [
    "KINDS",
    "FetchError",
    "FetchOptions",
    "ModelUri",
    "ModelUriError",
    "ResolvedModel",
    "parse",
    "parse_model_uri",
    "resolve_model",
]
