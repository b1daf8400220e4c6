"""Model URIs: `hf://org/name[@revision]`, `s3://bucket/prefix`, `pvc://claim/path` or a local path,
parsed into a `ModelUri`, and where each lives in the model cache (pure: no I/O). The operator
imports this module to render pods that find what `corral fetch-model` downloaded."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import urlsplit

Scheme = Literal["hf", "s3", "pvc", "local"]
REMOTE_SCHEMES: tuple[Scheme, ...] = ("hf", "s3")
DEFAULT_HF_REVISION = "main"

_URI = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<rest>.*)$")
# The Hub's repo names: letters, digits, '-', '_', '.', at most 96 characters per part.
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class ModelUriError(ValueError):
    """A URI that names no model (bad syntax or an unsupported scheme)."""


@dataclass(frozen=True, slots=True)
class ModelUri:
    """scheme, where (hf: org/name; s3: bucket; pvc: claim; local: the path) and what under it
    (s3: the key prefix; pvc: the path in the claim), plus the Hub revision."""

    text: str
    scheme: Scheme
    location: str
    path: str = ""
    revision: str | None = None

    @property
    def is_remote(self) -> bool:
        """Downloaded into the cache (hf, s3) rather than read where it lies (pvc, local)."""
        return self.scheme in REMOTE_SCHEMES

    @property
    def default_served_name(self) -> str:
        """The API model name when none is given: the Hub's repo id (org/name), else the last
        component of the path."""
        if self.scheme == "hf":
            return self.location
        tail = self.path or self.location
        return tail.rstrip("/").rsplit("/", 1)[-1]

    def with_revision(self, revision: str | None) -> ModelUri:
        """The same URI at `revision` (hf only); a different revision in the URI is an error."""
        if revision is None:
            return self
        if self.scheme != "hf":
            raise ModelUriError(f"--revision applies to hf:// URIs only, not {self.scheme}")
        if self.revision is not None and self.revision != revision:
            raise ModelUriError(f"the URI says @{self.revision} but --revision says {revision}")
        return ModelUri(self.text, "hf", self.location, revision=revision)


def parse_model_uri(text: str) -> ModelUri:
    """`text` as a ModelUri; anything without `scheme://` is a local path."""
    match = _URI.match(text)
    if match is None:
        if not text:
            raise ModelUriError("the model is empty")
        return ModelUri(text, "local", text)
    scheme, rest = match["scheme"].lower(), match["rest"]
    if scheme == "hf":
        return _parse_hf(text, rest)
    if scheme in ("s3", "pvc"):
        split = urlsplit(text)
        if split.query or split.fragment or not split.netloc:
            raise ModelUriError(f"{scheme}:// URIs are {scheme}://{_WHAT[scheme]}/PATH: {text!r}")
        path = _clean_path(split.path, text)
        if scheme == "pvc" and not path:
            raise ModelUriError(f"pvc:// URIs name a path in the claim: pvc://CLAIM/PATH, not {text!r}")
        return ModelUri(text, scheme, split.netloc, path)  # type: ignore[arg-type]
    raise ModelUriError(f"unsupported model URI scheme {scheme!r}: use hf://, s3://, pvc:// or a local path")


_WHAT = {"s3": "BUCKET", "pvc": "CLAIM"}


def _parse_hf(text: str, rest: str) -> ModelUri:
    repo, _, revision = rest.partition("@")
    parts = repo.strip("/").split("/")
    if not 1 <= len(parts) <= 2 or not all(_HF_PART.match(p) and ".." not in p for p in parts):
        raise ModelUriError(f"hf:// URIs are hf://ORG/NAME[@REVISION]: {text!r}")
    if "@" in rest and (not revision or ".." in revision or revision.startswith("/")):
        raise ModelUriError(f"bad revision in {text!r}")
    return ModelUri(text, "hf", "/".join(parts), revision=revision or None)


def _clean_path(path: str, text: str) -> str:
    """A relative path with no '.' or '..' components (it becomes part of a directory name)."""
    parts = [p for p in PurePosixPath(path).parts if p != "/"]
    if any(p in (".", "..") for p in parts):
        raise ModelUriError(f"'.' and '..' are not allowed in {text!r}")
    return "/".join(parts)


def cache_subdir(uri: ModelUri, endpoint: str | None = None) -> PurePosixPath:
    """Where `uri` lives under the cache directory: hf/ORG/NAME/REVISION, s3/HOST/BUCKET/PREFIX
    (HOST is 'aws' unless an endpoint is set, so two S3-compatible stores never share an entry)."""
    if uri.scheme == "hf":
        revision = (uri.revision or DEFAULT_HF_REVISION).replace("/", "--")
        return PurePosixPath("hf", uri.location, revision)
    if uri.scheme == "s3":
        host = (urlsplit(endpoint).netloc.replace(":", "_") if endpoint else "") or "aws"
        return PurePosixPath("s3", host, uri.location, uri.path or "_root")
    raise ValueError(f"{uri.scheme} models are not cached")
