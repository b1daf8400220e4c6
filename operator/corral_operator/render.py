"""Pure renderers: LLMDeployment spec -> the Kubernetes objects that serve it (no I/O).

Every object carries the managed labels and a controller owner reference, so the garbage collector
removes it with the LLMDeployment and the operator can prune what the spec no longer asks for.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from corral_operator import autoscalers, labels
from corral_operator.engine_command import corral_command, model_path_in_pod, vllm_args
from corral_operator.model_volumes import fetch_containers, model_volumes, s3_env
from corral_operator.pod_spec import ProbeTiming
from corral_operator.spec import API_VERSION, KIND, LLMDeploymentSpec

Obj = dict[str, Any]
SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"
RUN_AS_UID = 10001  # the corral images' user (docker/*.Dockerfile)
PORT_NAME = "http"


@dataclass(frozen=True, slots=True)
class Owner:
    """The LLMDeployment a child belongs to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])

    def reference(self) -> Obj:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def _metadata(owner: Owner, spec: LLMDeploymentSpec) -> Obj:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": labels.common(owner.name, spec.model.name, spec.engine.kind),
        "annotations": {labels.OWNER_ANNOTATION: owner.name},
        "ownerReferences": [owner.reference()],
    }


def _resources(spec: LLMDeploymentSpec) -> Obj:
    amounts: dict[str, str] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    if spec.resources.gpu:
        amounts["nvidia.com/gpu"] = str(spec.resources.gpu)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _probe(port_name: str, period_s: int, failures: int, timing: ProbeTiming | None) -> Obj:
    probe = {
        "httpGet": {"path": "/health", "port": port_name},
        "periodSeconds": period_s,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }
    return probe | (timing.model_dump(by_alias=True, exclude_none=True) if timing else {})


def _has_shm(spec: LLMDeploymentSpec) -> bool:
    """NCCL and vLLM's workers talk through /dev/shm; the runtime's default is 64Mi."""
    return spec.engine.kind == "vllm" or spec.resources.gpu > 0 or spec.pod.shm_size is not None


def _volumes(spec: LLMDeploymentSpec) -> tuple[list[Obj], list[Obj]]:
    """(pod volumes, engine mounts): the weights (or their cache), a writable /tmp, shared memory."""
    volumes, mounts = model_volumes(spec)
    volumes.append({"name": "tmp", "emptyDir": {}})
    mounts.append({"name": "tmp", "mountPath": "/tmp"})
    if _has_shm(spec):
        shm: Obj = {"medium": "Memory"}
        if spec.pod.shm_size:
            shm["sizeLimit"] = spec.pod.shm_size
        volumes.append({"name": "dshm", "emptyDir": shm})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes + list(spec.pod.volumes), mounts + list(spec.pod.volume_mounts)


def _env(spec: LLMDeploymentSpec) -> list[Obj]:
    # The root filesystem is read-only: caches go to the /tmp emptyDir.
    base = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    base += s3_env(spec)
    user = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.pod.env]
    user_names = {e["name"] for e in user}
    return [e for e in base if e["name"] not in user_names] + user


def _container_security(spec: LLMDeploymentSpec) -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
        **spec.pod.container_security_context,
    }


def _init_containers(spec: LLMDeploymentSpec) -> list[Obj]:
    """The model's and adapters' downloads, sized like the engine without its GPUs (they need none)."""
    resources = {
        k: {r: v for r, v in amounts.items() if r != "nvidia.com/gpu"}
        for k, amounts in _resources(spec).items()
    }
    return fetch_containers(spec, _container_security(spec), resources)


def engine_container(spec: LLMDeploymentSpec) -> Obj:
    model_path = model_path_in_pod(spec)
    port = spec.engine.port
    container: Obj = {
        "name": "engine",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
    }
    if spec.engine.kind == "corral":
        container["command"] = corral_command(spec, model_path, host="0.0.0.0", port=port)
    else:
        container["args"] = vllm_args(spec, model_path, port)
    _, mounts = _volumes(spec)
    probes = spec.pod.probes
    container |= {
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # Loading weights can take minutes; the startup probe holds liveness off until /health answers.
        "startupProbe": _probe(PORT_NAME, period_s=5, failures=360, timing=probes.startup),
        "readinessProbe": _probe(PORT_NAME, period_s=5, failures=2, timing=probes.readiness),
        "livenessProbe": _probe(PORT_NAME, period_s=10, failures=3, timing=probes.liveness),
        "securityContext": _container_security(spec),
    }
    if spec.pod.env_from:
        container["envFrom"] = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.pod.env_from]
    return container


def _pod_extras(owner: Owner, spec: LLMDeploymentSpec) -> Obj:
    """The pod-level escape hatches that are set (absent keys keep the API server's defaults)."""
    extras: Obj = {}
    if spec.pod.image_pull_secrets:
        extras["imagePullSecrets"] = [{"name": n} for n in spec.pod.image_pull_secrets]
    if spec.pod.runtime_class_name:
        extras["runtimeClassName"] = spec.pod.runtime_class_name
    if spec.pod.topology_spread_constraints:
        own = {"matchLabels": labels.selector(owner.name)}
        extras["topologySpreadConstraints"] = [
            {"labelSelector": own, **c.model_dump(by_alias=True, exclude_none=True)}
            for c in spec.pod.topology_spread_constraints
        ]
    return extras


def deployment(owner: Owner, spec: LLMDeploymentSpec) -> Obj:
    meta = _metadata(owner, spec)
    volumes, _ = _volumes(spec)
    pod_labels = {**spec.pod.labels, **meta["labels"]}
    pod_spec: Obj = {
        "containers": [engine_container(spec)],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_UID,
            "fsGroup": RUN_AS_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
            **spec.pod.security_context,
        },
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity.model_dump(by_alias=True, exclude_none=True)
    if spec.pod.service_account_name:
        pod_spec["serviceAccountName"] = spec.pod.service_account_name
    if spec.pod.priority_class_name:
        pod_spec["priorityClassName"] = spec.pod.priority_class_name
    pod_spec |= _pod_extras(owner, spec)
    if init := _init_containers(spec):
        pod_spec["initContainers"] = init
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": spec.bounded_replicas,
            "selector": {"matchLabels": labels.selector(owner.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            "template": {
                "metadata": {"labels": pod_labels, "annotations": dict(spec.pod.annotations)},
                "spec": pod_spec,
            },
        },
    }


def service(owner: Owner, spec: LLMDeploymentSpec) -> Obj:
    port = spec.engine.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, spec),
        "spec": {
            "type": "ClusterIP",
            "selector": labels.selector(owner.name),
            "ports": [{"name": PORT_NAME, "port": port, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(owner: Owner, spec: LLMDeploymentSpec) -> Obj:
    """At most one serving pod evicted at a time, at any size: at one replica the budget still allows
    one, so a drain never waits on it (as with no budget), and it stays while an autoscaler moves
    between 1 and 2 replicas instead of being deleted and recreated each time. Pods that are not
    ready (crash-looping, loading) serve nothing, so they may always go: with the default policy
    two crash-looping replicas blocked every drain of their nodes for good."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, spec),
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": labels.selector(owner.name)},
        },
    }


def service_monitor(
    owner: Owner, spec: LLMDeploymentSpec, extra_labels: Mapping[str, str] = {}, interval: str = "15s"
) -> Obj:
    """Scrapes the engines every `interval`; `extra_labels` are what the cluster's Prometheus selects
    monitors by (the operator's own labels win a clash)."""
    metadata = _metadata(owner, spec)
    metadata["labels"] = {**extra_labels, **metadata["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": labels.selector(owner.name)},
            # Series say which LLMDeployment they come from (KEDA's triggers select by it).
            "podTargetLabels": [labels.INSTANCE],
            "endpoints": [{"port": PORT_NAME, "path": "/metrics", "interval": interval}],
        },
    }


def endpoint_url(owner: Owner, spec: LLMDeploymentSpec) -> str:
    """In-cluster URL of the Service (cluster domain omitted: resolvable from any namespace)."""
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.engine.port}"


def desired_objects(
    owner: Owner,
    spec: LLMDeploymentSpec,
    *,
    crds: Collection[str],
    monitor_labels: Mapping[str, str] = {},
    monitor_interval: str = "15s",
) -> list[Obj]:
    """Everything the spec asks for; objects of optional CRDs (ServiceMonitor, ScaledObject) only
    when `crds` (installed CRD names) has them."""
    objects = [deployment(owner, spec), service(owner, spec), pod_disruption_budget(owner, spec)]
    if SERVICE_MONITOR_CRD in crds:
        objects.append(service_monitor(owner, spec, monitor_labels, monitor_interval))
    mode = spec.autoscaling.mode if spec.autoscaling else None
    if mode == "hpa":
        objects.append(autoscalers.horizontal_pod_autoscaler(_metadata(owner, spec), spec))
    elif mode == "keda" and autoscalers.SCALED_OBJECT_CRD in crds:
        objects.append(autoscalers.scaled_object(_metadata(owner, spec), spec))
    return objects
