"""Pure rendering of where an engine pod gets its weights and LoRA adapters: the model volume and
mount, the claims pvc:// adapters are on, and for hf:// and s3:// models and adapters the download
cache and the init containers that fill it, one per source (docs/models.md)."""

from __future__ import annotations

from typing import Any

from corral_engine import wire
from corral_engine.sources.uri import parse_model_uri

from corral_operator.engine_command import MODEL_CACHE_PATH, MODEL_MOUNT_PATH, PVC_ROOT, fetch_command
from corral_operator.pod_spec import RESERVED_VOLUME_PREFIX
from corral_operator.spec import LLMDeploymentSpec

Obj = dict[str, Any]
# Adapters' own volumes are named ADAPTER_VOLUME_PREFIX + N (pod_spec reserves the prefix) and their
# init containers ADAPTER_FETCH_PREFIX + N, N the adapter's place in spec.adapters (status reads it).
ADAPTER_VOLUME_PREFIX = RESERVED_VOLUME_PREFIX
ADAPTER_FETCH_PREFIX = "fetch-adapter-"


def model_volumes(spec: LLMDeploymentSpec) -> tuple[list[Obj], list[Obj]]:
    """(pod volumes, engine mounts) holding the checkpoint, its adapters, or the cache they are
    downloaded into."""
    volumes, mounts = _model_volume(spec)
    if spec.is_any_downloaded and not spec.model.is_downloaded:
        volumes.append(_cache_volume(spec))
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_PATH})
    mounted = {m["mountPath"] for m in mounts}
    for i, adapter in enumerate(spec.adapters):
        uri = parse_model_uri(adapter.uri)
        where = f"{PVC_ROOT}/{uri.location}"
        if uri.scheme != "pvc" or where in mounted:  # the model's own claim is mounted already
            continue
        name = f"{ADAPTER_VOLUME_PREFIX}{i}"
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": uri.location, "readOnly": True}})
        mounts.append({"name": name, "mountPath": where, "readOnly": True})
        mounted.add(where)
    return volumes, mounts


def _cache_volume(spec: LLMDeploymentSpec) -> Obj:
    cache = spec.model.cache
    if cache.claim_name:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
    return {"name": "model-cache", "emptyDir": {"sizeLimit": cache.size_limit} if cache.size_limit else {}}


def _model_volume(spec: LLMDeploymentSpec) -> tuple[list[Obj], list[Obj]]:
    """(pod volumes, engine mounts) of the model alone."""
    model = spec.model
    if model.uri is not None:
        uri = parse_model_uri(model.uri)
        if uri.scheme == "pvc":  # read in place: the claim at PVC_ROOT/CLAIM
            claim = {"persistentVolumeClaim": {"claimName": uri.location, "readOnly": True}}
            mount = {"name": "model", "mountPath": f"{PVC_ROOT}/{uri.location}", "readOnly": True}
            return [{"name": "model", **claim}], [mount]
        return [_cache_volume(spec)], [{"name": "model-cache", "mountPath": MODEL_CACHE_PATH}]
    source = model.source
    if source is not None and source.pvc is not None:
        volume: Obj = {"persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}}
    elif source is not None and source.host_path is not None:
        volume = {"hostPath": {"path": source.host_path.path, "type": "Directory"}}
    else:  # unreachable for a validated spec (exactly one of uri and source)
        raise ValueError("spec.model has neither uri nor source")
    return [{"name": "model", **volume}], [{"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}]


def s3_env(spec: LLMDeploymentSpec) -> list[Obj]:
    """The S3 endpoint is part of a cached entry's path, so the engine needs it as well."""
    endpoint = spec.model.s3_endpoint
    return [{"name": "AWS_ENDPOINT_URL", "value": endpoint}] if endpoint else []


def fetch_containers(spec: LLMDeploymentSpec, security_context: Obj, resources: Obj) -> list[Obj]:
    """The init containers downloading an hf:// or s3:// model, then each such adapter, into the
    cache (none for pvc:// and volumes). Credentials reach only these; each one's exit code says why
    its download failed (wire.FETCH_EXIT_REASONS) and its last log line, the termination message,
    what happened."""
    sources = [(wire.FETCH_CONTAINER, spec.model.uri)] if spec.model.is_downloaded else []
    sources += [(f"{ADAPTER_FETCH_PREFIX}{i}", a.uri) for i, a in enumerate(spec.adapters) if a.is_downloaded]
    return [_fetcher(spec, name, str(uri), security_context, resources) for name, uri in sources]


def _fetcher(spec: LLMDeploymentSpec, name: str, uri: str, security_context: Obj, resources: Obj) -> Obj:
    model = spec.model
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "0"},  # the images set 1 for the serving container
        *s3_env(spec),
    ]
    container: Obj = {
        "name": name,
        "image": model.fetcher_image or spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": fetch_command(spec, uri),
        "env": env,
        "resources": resources,
        "volumeMounts": [
            {"name": "model-cache", "mountPath": MODEL_CACHE_PATH},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": security_context,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if model.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": model.credentials_secret}}]
    return container
