"""Pure rendering of where an engine pod gets its weights: the model volume and mount, and for
hf:// and s3:// models the download cache and the init container that fills it (docs/models.md)."""

from __future__ import annotations

from typing import Any

from corral_engine import wire
from corral_engine.sources.uri import parse_model_uri

from corral_operator.engine_command import MODEL_CACHE_PATH, MODEL_MOUNT_PATH, PVC_ROOT, fetch_command
from corral_operator.spec import LLMDeploymentSpec

Obj = dict[str, Any]


def model_volumes(spec: LLMDeploymentSpec) -> tuple[list[Obj], list[Obj]]:
    """(pod volumes, engine mounts) holding the checkpoint or the cache it is downloaded into."""
    model = spec.model
    if model.uri is not None:
        uri = parse_model_uri(model.uri)
        if uri.scheme == "pvc":  # read in place: the claim at PVC_ROOT/CLAIM
            claim = {"persistentVolumeClaim": {"claimName": uri.location, "readOnly": True}}
            mount = {"name": "model", "mountPath": f"{PVC_ROOT}/{uri.location}", "readOnly": True}
            return [{"name": "model", **claim}], [mount]
        cache: Obj
        if model.cache.claim_name:
            cache = {"persistentVolumeClaim": {"claimName": model.cache.claim_name}}
        else:
            cache = {"emptyDir": {"sizeLimit": model.cache.size_limit} if model.cache.size_limit else {}}
        return [{"name": "model-cache", **cache}], [{"name": "model-cache", "mountPath": MODEL_CACHE_PATH}]
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


def fetch_container(spec: LLMDeploymentSpec, security_context: Obj, resources: Obj) -> Obj | None:
    """The init container downloading an hf:// or s3:// model into the cache, or None. Credentials
    reach only this container; its exit code says why a download failed (wire.FETCH_EXIT_REASONS)
    and its last log line, as the termination message, what happened."""
    model = spec.model
    if not model.is_downloaded:
        return None
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "0"},  # the images set 1 for the serving container
        *s3_env(spec),
    ]
    container: Obj = {
        "name": wire.FETCH_CONTAINER,
        "image": model.fetcher_image or spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": fetch_command(spec),
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
