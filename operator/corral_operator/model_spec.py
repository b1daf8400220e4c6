"""`spec.model` and `spec.adapters`: the served names and where the checkpoint and its LoRA adapters
come from (a URI, downloaded by an init container into a cache volume, or a volume already holding it)."""

from __future__ import annotations

from typing import Annotated

from corral_engine.sources.uri import ModelUriError, parse_model_uri
from pydantic import ConfigDict, Field, model_validator

from corral_operator.spec_base import MEMORY_PATTERN, SpecModel, cel, validations


class PvcSource(SpecModel):
    """Weights on a PersistentVolumeClaim, mounted read-only at /models."""

    claim_name: str = Field(min_length=1, max_length=253, description="PVC in the same namespace.")
    path: str = Field(
        default="",
        max_length=1024,
        pattern=r"^[^/].*$|^$",
        description="Relative path of the checkpoint directory inside the claim ('' = the root).",
    )


class HostPathSource(SpecModel):
    """Weights in a directory on the node (single-node and test clusters)."""

    path: str = Field(min_length=1, max_length=1024, pattern=r"^/", description="Absolute path on the node.")


class ModelSource(SpecModel):
    """Where the weights are: exactly one of pvc or hostPath."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("has(self.pvc) != has(self.hostPath)", "model.source needs exactly one of pvc or hostPath")
        )
    )
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.pvc is None) == (self.host_path is None):
            raise ValueError("model.source needs exactly one of pvc or hostPath")
        return self


class ModelCache(SpecModel):
    """Where hf:// and s3:// models are downloaded: a shared PVC (one download per cache, under a
    lock; ReadWriteMany for several nodes) or, without a claim, an emptyDir per pod."""

    claim_name: str | None = Field(default=None, max_length=253, description="PVC holding the cache.")
    size_limit: str | None = Field(
        default=None, pattern=MEMORY_PATTERN, description="emptyDir size limit (no claimName)."
    )


# OpenAI-style model ids: letters, digits and . _ - : / (e.g. meta-llama/Llama-3.1-8B-Instruct),
# starting and ending with a letter or digit.
SERVED_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._:/-]{0,126}[A-Za-z0-9])?$"
ServedName = Annotated[str, Field(pattern=SERVED_NAME_PATTERN, max_length=128)]
ALIAS_MESSAGE = "model.aliases must differ from model.name and from each other"
ONE_SOURCE_MESSAGE = "model needs exactly one of uri or source"
URI_PATTERN = r"^(hf|s3|pvc)://[^\s]+$"


class ModelSpec(SpecModel):
    """The model: its served name(s) and where its checkpoint (config, tokenizer, weights) lives."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.aliases) || (!(self.name in self.aliases)"
                " && self.aliases.all(a, self.aliases.exists_one(b, b == a)))",
                ALIAS_MESSAGE,
            ),
            cel("has(self.uri) != has(self.source)", ONE_SOURCE_MESSAGE),
        )
    )
    name: ServedName = Field(
        description="Served model name (the OpenAI `model`), e.g. meta-llama/Llama-3.1-8B-Instruct.",
    )
    aliases: list[ServedName] = Field(
        default_factory=list,
        max_length=8,
        description="More names clients may ask for; the gateway routes them here and sends `name` upstream.",
    )
    uri: str | None = Field(
        default=None,
        pattern=URI_PATTERN,
        max_length=2048,
        description="hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or pvc://CLAIM/PATH (docs/models.md).",
    )
    source: ModelSource | None = Field(default=None, description="A volume holding the checkpoint.")
    cache: ModelCache = Field(default_factory=ModelCache, description="Download cache (hf://, s3://).")
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        description="Secret with HF_TOKEN or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (the download only).",
    )
    s3_endpoint: str | None = Field(
        default=None, pattern=r"^https?://", max_length=2048, description="S3-compatible store (MinIO, Ceph)."
    )
    fetcher_image: str | None = Field(
        default=None,
        max_length=512,
        description="Image running `corral fetch-model` (default: the engine image; required for vllm).",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.name in self.aliases or len(set(self.aliases)) != len(self.aliases):
            raise ValueError(ALIAS_MESSAGE)
        if (self.uri is None) == (self.source is None):
            raise ValueError(ONE_SOURCE_MESSAGE)
        if self.uri is not None:
            _check_uri("model.uri", self.uri)
        return self

    @property
    def is_downloaded(self) -> bool:
        """hf:// and s3:// models come through the cache (an init container fetches them)."""
        return self.uri is not None and not self.uri.startswith("pvc://")

    @property
    def claims(self) -> list[str]:
        """The PersistentVolumeClaims the engine pods mount for the model (weights or cache)."""
        if self.uri is not None and self.uri.startswith("pvc://"):
            return [parse_model_uri(self.uri).location]
        if self.uri is not None:
            return [self.cache.claim_name] if self.cache.claim_name else []
        return [self.source.pvc.claim_name] if self.source is not None and self.source.pvc is not None else []


def _check_uri(where: str, uri: str) -> None:
    try:
        parse_model_uri(uri)
    except ModelUriError as e:
        raise ValueError(f"{where}: {e}") from e


class AdapterSpec(SpecModel):
    """A LoRA adapter (PEFT: adapter_config.json, adapter_model.safetensors) served under its own name."""

    name: ServedName = Field(description="Served name of the adapter (the OpenAI `model` that selects it).")
    uri: str = Field(
        pattern=URI_PATTERN,
        max_length=2048,
        description="hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or pvc://CLAIM/PATH, as model.uri; "
        "fetched with the model's credentials, S3 endpoint and cache.",
    )

    @model_validator(mode="after")
    def _check(self) -> AdapterSpec:
        _check_uri(f"adapters {self.name}: uri", self.uri)
        return self

    @property
    def is_downloaded(self) -> bool:
        """hf:// and s3:// adapters come through the model cache, as such models do."""
        return not self.uri.startswith("pvc://")
