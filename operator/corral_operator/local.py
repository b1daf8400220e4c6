"""An LLMDeployment as a local fleet: what `corral up -f FILE` runs (pure; no processes started here).

One YAML works on a laptop and on a cluster: the same spec parsing, the same engine arguments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from corral_engine.args import EngineArgs

from corral_operator.crd import NAME_MESSAGE, NAME_PATTERN
from corral_operator.engine_command import engine_args
from corral_operator.spec import API_VERSION, KIND, SpecError, parse_spec


@dataclass(frozen=True, slots=True)
class LocalFleet:
    """Parameters for one model's local engines: run `replicas` x `corral engine` with these args."""

    name: str  # metadata.name of the LLMDeployment
    namespace: str  # metadata.namespace, "default" when absent (as kubectl would)
    served_model_name: str
    aliases: tuple[str, ...]  # spec.model.aliases: other names clients may ask for
    engine_kind: str  # "corral"; "vllm" cannot run locally through corral up
    replicas: int
    engine_args: EngineArgs
    extra_args: tuple[str, ...]
    adapters: tuple[tuple[str, str], ...] = ()  # spec.adapters: (served name, hf:// or s3:// URI)
    s3_endpoint: str | None = None  # spec.model.s3Endpoint: the adapters' too, as on a cluster


def local_fleet(document: Mapping[str, Any], model_path: str | None = None) -> LocalFleet:
    """Map one LLMDeployment document to local fleet parameters.

    The weights come from `model_path` when given, else from spec.model.uri (hf://, s3://) or
    spec.model.source.hostPath (a PVC has no local meaning; nor has a pvc:// adapter). Replicas:
    spec.replicas, raised to autoscaling.minReplicas and to at least 1.
    """
    if document.get("apiVersion") != API_VERSION or document.get("kind") != KIND:
        raise SpecError(f"expected apiVersion {API_VERSION} and kind {KIND}")
    name = str((document.get("metadata") or {}).get("name") or "")
    if not name:
        raise SpecError("metadata.name is required")
    if not re.fullmatch(NAME_PATTERN, name) or len(name) > 63:  # as the cluster's CRD refuses it
        raise SpecError(f"{NAME_MESSAGE}; got {name!r}")
    spec = parse_spec(document.get("spec"))
    for adapter in spec.adapters:  # refused rather than dropped: its requests would find no model
        if not adapter.is_downloaded:
            raise SpecError(
                f"spec.adapters {adapter.name}: {adapter.uri} is on a PVC, which has no local equivalent; "
                "give it as hf:// or s3://, or run `corral engine --enable-lora --lora-modules NAME=DIR`"
            )
    source = spec.model.source
    path = model_path
    if path is None and spec.model.is_downloaded:
        path = spec.model.uri  # each engine fetches it through the local model cache (one download)
    if path is None and source is not None and source.host_path is not None:
        path = source.host_path.path
    if path is None:
        raise SpecError(
            "spec.model is on a PVC, which has no local equivalent; give the checkpoint directory "
            "(corral up --model-path DIR)"
        )
    floor = spec.autoscaling.min_replicas if spec.autoscaling else 0
    return LocalFleet(
        name=name,
        namespace=str((document.get("metadata") or {}).get("namespace") or "default"),
        served_model_name=spec.model.name,
        aliases=tuple(spec.model.aliases),
        engine_kind=spec.engine.kind,
        replicas=max(spec.replicas, floor, 1),
        engine_args=engine_args(spec, path),
        extra_args=tuple(spec.engine.extra_args),
        adapters=tuple((a.name, a.uri) for a in spec.adapters),
        s3_endpoint=spec.model.s3_endpoint,
    )


def local_fleets(yaml_text: str, model_path: str | None = None) -> list[LocalFleet]:
    """Every LLMDeployment in a (multi-document) YAML file; other kinds are ignored."""
    try:
        documents = [d for d in yaml.safe_load_all(yaml_text) if isinstance(d, dict)]
    except yaml.YAMLError as e:
        raise SpecError(f"not valid YAML: {e}") from e
    fleets = [local_fleet(d, model_path) for d in documents if d.get("kind") == KIND]
    if not fleets:
        raise SpecError(f"no {KIND} found in the file")
    seen: set[tuple[str, str]] = set()
    for f in fleets:
        if (f.namespace, f.name) in seen:  # applied to a cluster, the second would replace the first
            raise SpecError(f"two {KIND}s named {f.name!r} in namespace {f.namespace!r}")
        seen.add((f.namespace, f.name))
    return fleets
