"""Invalid LLMDeployment specs and the message each must be rejected with.

Shared by the unit tests (the pydantic model) and the e2e tests (the API server's CRD schema), so the
two layers are held to the same contract.
"""

from __future__ import annotations

import copy
from typing import Any


def valid_spec() -> dict[str, Any]:
    return {
        "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny"}}},
        "engine": {"image": "corral-engine:test", "args": {"maxNumSeqs": 8}},
        "replicas": 2,
    }


def _with(path: str, value: Any) -> dict[str, Any]:
    """valid_spec() with `value` at dotted `path` (None deletes the key)."""
    spec = valid_spec()
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = copy.deepcopy(value)
    return spec


# (case id, spec, substring the rejection message must contain)
INVALID_SPECS: list[tuple[str, dict[str, Any], str]] = [
    (
        "min-above-max",
        _with("autoscaling", {"minReplicas": 3, "maxReplicas": 2}),
        "minReplicas must be <= maxReplicas",
    ),
    (
        "block-size-not-power-of-two",
        _with("engine.args", {"blockSize": 24}),
        "blockSize must be a power of two",
    ),
    ("unknown-kv-policy", _with("engine.args", {"kvPolicy": "lru"}), "kvPolicy"),
    ("unknown-tool-call-parser", _with("engine.args", {"toolCallParser": "granite"}), "toolCallParser"),
    ("unknown-reasoning-parser", _with("engine.args", {"reasoningParser": "granite"}), "reasoningParser"),
    ("unknown-quantization", _with("engine.args", {"quantization": "bitsandbytes"}), "quantization"),
    (
        "media-domains-not-a-list",
        _with("engine.args", {"allowedMediaDomains": "a.example"}),
        "allowedMediaDomains",
    ),
    ("empty-media-domain", _with("engine.args", {"allowedMediaDomains": [""]}), "allowedMediaDomains"),
    ("unknown-engine-kind", _with("engine.kind", "tgi"), "engine.kind"),
    ("no-model-source", _with("model.source", {}), "exactly one of pvc or hostPath"),
    (
        "two-model-sources",
        _with("model.source", {"hostPath": {"path": "/m"}, "pvc": {"claimName": "models"}}),
        "exactly one of pvc or hostPath",
    ),
    ("negative-replicas", _with("replicas", -1), "replicas"),
    ("blocks-and-bytes", _with("engine.args", {"numKvBlocks": 64, "kvCacheMemory": "1Gi"}), "not both"),
    (
        "vllm-with-corral-option",
        _with(
            "engine", {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": {"kvPolicy": "reserve"}}
        ),
        "corral engine options",
    ),
    ("rollout-cannot-progress", _with("rollout", {"maxSurge": 0, "maxUnavailable": 0}), "cannot both be 0"),
    ("reserved-pod-label", _with("pod", {"labels": {"app.kubernetes.io/name": "x"}}), "may not set"),
    ("model-name-not-a-label", _with("model.name", "meta llama/8B"), "model.name"),
    ("no-image", _with("engine.image", None), "engine.image"),
    ("kv-target-above-one", _with("autoscaling", {"targetKvUsage": 1.5}), "targetKvUsage"),
    (
        "token-budget-below-seqs",
        _with("engine.args", {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}),
        "maxNumSeqs must be <= maxNumBatchedTokens",
    ),
    ("bad-kv-memory", _with("engine.args", {"kvCacheMemory": "lots"}), "kvCacheMemory"),
    ("zero-cpu", _with("resources", {"cpu": "0"}), "cpu"),
    ("zero-memory", _with("resources", {"memory": "0.0Gi"}), "memory"),
    ("memory-in-gb", _with("resources", {"memory": "4GB"}), "memory"),
    ("memory-in-millibytes", _with("resources", {"memory": "100m"}), "memory"),
    (
        "gpu-memory-on-a-cpu-pod",
        _with("engine.args", {"gpuMemoryUtilization": 0.8}),
        "gpuMemoryUtilization applies to GPU pods",
    ),
    ("gpu-memory-above-one", _with("engine.args", {"gpuMemoryUtilization": 1.5}), "gpuMemoryUtilization"),
    ("relative-host-path", _with("model.source", {"hostPath": {"path": "models/x"}}), "path"),
    (
        "speculative-lookup-min-above-max",
        _with("engine.args.speculative", {"promptLookupMin": 4, "promptLookupMax": 2}),
        "promptLookupMin must be <= promptLookupMax",
    ),
    ("speculative-unknown-method", _with("engine.args.speculative", {"method": "eagle"}), "method"),
    (
        "speculative-too-many-tokens",
        _with("engine.args.speculative", {"numSpeculativeTokens": 64}),
        "numSpeculativeTokens",
    ),
    ("shm-size-not-a-quantity", _with("pod", {"shmSize": "lots"}), "shmSize"),
    ("probe-period-zero", _with("pod", {"probes": {"readiness": {"periodSeconds": 0}}}), "periodSeconds"),
    (
        "hpa-to-zero",
        _with("autoscaling", {"mode": "hpa", "minReplicas": 0, "maxReplicas": 2}),
        "an HPA cannot scale to zero",
    ),
    ("keda-without-prometheus", _with("autoscaling", {"mode": "keda"}), "prometheusUrl is required"),
    ("unknown-autoscaling-mode", _with("autoscaling", {"mode": "vpa"}), "mode"),
    (
        "uri-and-source",
        _with("model", {"name": "m", "uri": "hf://org/m", "source": {"hostPath": {"path": "/m"}}}),
        "exactly one of uri or source",
    ),
    ("neither-uri-nor-source", _with("model", {"name": "m"}), "exactly one of uri or source"),
    ("uri-scheme", _with("model", {"name": "m", "uri": "gs://bucket/m"}), "uri"),
    (
        "vllm-hf-without-fetcher",
        {
            **valid_spec(),
            "model": {"name": "m", "uri": "hf://org/m"},
            "engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"},
        },
        "fetcherImage is required",
    ),
    (
        "alias-equals-name",
        _with("model", {"name": "m", "aliases": ["m"], "source": {"hostPath": {"path": "/m"}}}),
        "aliases must differ",
    ),
    (
        "rollout-surge-not-a-count-or-percentage",
        _with("rollout", {"maxSurge": "abc"}),
        "must be a whole number or a percentage such as 25%",
    ),
    (
        "rollout-unavailable-a-bare-number-string",
        _with("rollout", {"maxUnavailable": "5"}),
        "must be a whole number or a percentage such as 25%",
    ),
    # affinity and topologySpreadConstraints are typed: a typo is refused at admission
    ("affinity-typo", _with("affinity", {"nodeAfinity": {}}), "nodeAfinity"),
    (
        "anti-affinity-term-without-topology-key",
        _with(
            "affinity",
            {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}},
        ),
        "topologyKey",
    ),
    (
        "affinity-weight-above-100",
        _with(
            "affinity",
            {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 500, "preference": {"matchFields": []}}
                    ]
                }
            },
        ),
        "weight",
    ),
    (
        "spread-without-max-skew",
        _with(
            "pod",
            {"topologySpreadConstraints": [{"topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]},
        ),
        "maxSkew",
    ),
    (
        "volume-named-like-the-operators-own",
        _with("pod", {"volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory"}}]}),
        "pod.volumes may not use the names model, model-cache, tmp, dshm",
    ),
    (
        "mount-over-the-operators-own",
        _with("pod", {"volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]}),
        "pod.volumeMounts may not use the paths",
    ),
    (
        "two-volumes-one-name",
        _with("pod", {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}),
        "Duplicate value",
    ),
    (
        "two-env-vars-one-name",
        _with("pod", {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
        "Duplicate value",
    ),
    ("env-from-unknown-field", _with("pod", {"envFrom": [{"bogus": 1}]}), "bogus"),
    (
        "volume-named-like-an-adapters-claim",
        _with("pod", {"volumes": [{"name": "adapters-0", "emptyDir": {}}]}),
        "may not use the names model, model-cache, tmp, dshm or adapters-*",
    ),
    (
        "two-adapters-one-name",
        _with("adapters", [{"name": "sql", "uri": "hf://org/a"}, {"name": "sql", "uri": "hf://org/b"}]),
        "adapters must have distinct names",
    ),
    (
        "adapter-named-like-the-model",
        _with("adapters", [{"name": "tiny-llama", "uri": "hf://org/a"}]),
        "adapters' names must differ from model.name and model.aliases",
    ),
    (
        "adapter-named-like-an-alias",
        {
            **_with("adapters", [{"name": "tiny", "uri": "pvc://loras/a"}]),
            "model": {**valid_spec()["model"], "aliases": ["tiny"]},
        },
        "adapters' names must differ from model.name and model.aliases",
    ),
    ("adapter-name-not-a-model-id", _with("adapters", [{"name": "sql lora", "uri": "hf://o/a"}]), "name"),
    ("adapter-uri-scheme", _with("adapters", [{"name": "sql", "uri": "gs://bucket/a"}]), "uri"),
    ("adapter-without-uri", _with("adapters", [{"name": "sql"}]), "uri"),
    (
        "too-many-adapters",
        _with("adapters", [{"name": f"a{i}", "uri": f"hf://org/a{i}"} for i in range(17)]),
        "adapters",
    ),
    (
        "vllm-hf-adapter-without-fetcher",
        {
            **valid_spec(),
            "model": {"name": "m", "uri": "pvc://weights/m"},
            "engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"},
            "adapters": [{"name": "sql", "uri": "s3://bucket/sql"}],
        },
        "fetcherImage is required",
    ),
]
