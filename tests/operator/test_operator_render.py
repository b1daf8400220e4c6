"""Pure renderers: Deployment, Service, PDB, ServiceMonitor, and the engine command lines."""

from __future__ import annotations

import copy
import json

import pytest
from corral_operator import labels, render
from corral_operator.spec import SpecError, parse_spec

from tests.operator.invalid_cases import valid_spec

OWNER = render.Owner(name="tiny", namespace="ml", uid="uid-123")


def _spec(**changes: object):
    raw = valid_spec()
    for key, value in changes.items():
        raw[key] = value
    return parse_spec(raw)


def test_every_child_has_managed_labels_and_a_controller_owner_reference() -> None:
    objects = render.desired_objects(OWNER, _spec(), crds={render.SERVICE_MONITOR_CRD})
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"]
    for obj in objects:
        meta = obj["metadata"]
        assert meta["name"] == "tiny" and meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [OWNER.reference()]
        assert meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"][labels.MANAGED_BY] == "corral-operator"
        assert meta["labels"][labels.MODEL] == "tiny-llama"
        assert meta["labels"][labels.INSTANCE] == "tiny"


def test_one_replica_keeps_a_budget_that_lets_a_drain_evict_it_and_no_monitor_without_its_crd() -> None:
    objects = render.desired_objects(OWNER, _spec(replicas=1), crds=())
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "PodDisruptionBudget"]
    # maxUnavailable 1 allows one eviction at one replica (a drain goes on, as without a budget);
    # minAvailable 1 would block every drain of the node forever. Pods that are not ready may always
    # be evicted: two crash-looping replicas must not block drains either (the default policy did).
    assert objects[2]["spec"] == {
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
        "selector": {"matchLabels": labels.selector("tiny")},
    }


def test_deployment_is_locked_down() -> None:
    dep = render.deployment(OWNER, _spec())
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "4Gi"}


def test_selector_is_stable_when_the_model_name_changes() -> None:
    raw = valid_spec()
    renamed = copy.deepcopy(raw)
    renamed["model"]["name"] = "other"
    a = render.deployment(OWNER, parse_spec(raw))["spec"]["selector"]
    b = render.deployment(OWNER, parse_spec(renamed))["spec"]["selector"]
    assert a == b == {"matchLabels": labels.selector("tiny")}


def test_corral_engine_command_uses_engine_args() -> None:
    raw = valid_spec()
    raw["engine"]["args"] = {
        "maxNumSeqs": 8,
        "blockSize": 32,
        "kvCacheMemory": "256Mi",
        "kvPolicy": "reserve",
    }
    raw["engine"]["extraArgs"] = ["--seed", "7"]
    command = render.engine_container(parse_spec(raw))["command"]
    assert command[:4] == ["corral", "engine", "--model", "/models"]
    flags = dict(zip(command[4::2], command[5::2], strict=False))
    assert flags["--served-model-name"] == "tiny-llama"
    assert flags["--max-num-seqs"] == "8"
    assert flags["--block-size"] == "32"
    assert flags["--kv-cache-memory"] == str(256 << 20)
    assert flags["--kv-policy"] == "reserve"
    assert flags["--port"] == "8000"
    assert command[-2:] == ["--seed", "7"]


def test_vllm_gets_vllm_flags_gpu_and_shared_memory() -> None:
    raw = valid_spec()
    raw["engine"] = {
        "kind": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "args": {"maxNumSeqs": 16, "enablePrefixCaching": False, "numKvBlocks": 100},
    }
    raw["model"]["source"] = {"pvc": {"claimName": "models", "path": "llama"}}
    raw["resources"] = {"gpu": 1}
    spec = parse_spec(raw)
    dep = render.deployment(OWNER, spec)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in container
    args = container["args"]
    assert args[:2] == ["--model", "/models/llama"]
    assert "--no-enable-prefix-caching" in args
    assert args[args.index("--num-gpu-blocks-override") + 1] == "100"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in volumes
    claim = next(v for v in volumes if v["name"] == "model")["persistentVolumeClaim"]
    assert claim == {"claimName": "models", "readOnly": True}


@pytest.mark.parametrize("kind", ["corral", "vllm"])
def test_gpu_pods_pass_the_memory_share_and_graph_switch_to_either_engine(kind: str) -> None:
    raw = valid_spec()
    raw["engine"] = {
        "kind": kind,
        "image": "engine:test",
        "args": {"gpuMemoryUtilization": 0.8, "enforceEager": True},
    }
    raw["resources"] = {"gpu": 1}
    container = render.engine_container(parse_spec(raw))
    argv = container.get("command", []) + container.get("args", [])
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.8"
    assert "--enforce-eager" in argv
    del raw["engine"]["args"]["gpuMemoryUtilization"]  # unset: both engines' default share, 0.9
    container = render.engine_container(parse_spec(raw))
    assert "--gpu-memory-utilization" not in container.get("command", []) + container.get("args", [])


def test_speculative_decoding_reaches_both_engines() -> None:
    raw = valid_spec()
    raw["engine"]["args"] = {"speculative": {"numSpeculativeTokens": 3, "promptLookupMax": 4}}
    command = render.engine_container(parse_spec(raw))["command"]
    flags = dict(zip(command[4::2], command[5::2], strict=False))
    assert flags["--speculative"] == "ngram"
    assert flags["--num-speculative-tokens"] == "3"
    assert flags["--prompt-lookup-max"] == "4"
    assert "--prompt-lookup-min" not in flags  # unset: the engine's default
    # (tests/server/test_engine_cli.py checks that `corral engine` parses these flags back.)

    raw["engine"] = {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": raw["engine"]["args"]}
    args = render.engine_container(parse_spec(raw))["args"]
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def test_the_tool_call_parser_reaches_both_engines() -> None:
    raw = valid_spec()
    raw["engine"]["args"] = {"toolCallParser": "hermes"}
    command = render.engine_container(parse_spec(raw))["command"]
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" not in command  # the bundled engine: the parser turns auto on
    raw["engine"] = {
        "kind": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "args": {"toolCallParser": "llama3_json"},
    }
    args = render.engine_container(parse_spec(raw))["args"]
    at = args.index("--tool-call-parser")
    assert args[at - 1 : at + 2] == ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    raw["engine"]["args"] = {}  # unset: neither flag, so vLLM refuses "auto" as the engine does
    args = render.engine_container(parse_spec(raw))["args"]
    assert "--tool-call-parser" not in args and "--enable-auto-tool-choice" not in args


def test_the_reasoning_parser_reaches_both_engines() -> None:
    raw = valid_spec()
    raw["engine"]["args"] = {"reasoningParser": "qwen3"}
    command = render.engine_container(parse_spec(raw))["command"]
    assert command[command.index("--reasoning-parser") + 1] == "qwen3"
    raw["engine"] = {
        "kind": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "args": {"reasoningParser": "deepseek_r1"},
    }
    args = render.engine_container(parse_spec(raw))["args"]
    assert args[args.index("--reasoning-parser") + 1] == "deepseek_r1"


@pytest.mark.parametrize("kind", ["corral", "vllm"])
def test_quantization_reaches_either_engine_and_corral_up(kind: str) -> None:
    raw = valid_spec()
    raw["engine"] = {"kind": kind, "image": "engine:test", "args": {"quantization": "fp8"}}
    raw["resources"] = {"gpu": 1}
    container = render.engine_container(parse_spec(raw))
    argv = container.get("command", []) + container.get("args", [])
    assert argv[argv.index("--quantization") + 1] == "fp8"
    raw["engine"]["args"] = {}  # unset: the checkpoint says (an FP8 one is read as FP8)
    container = render.engine_container(parse_spec(raw))
    assert "--quantization" not in container.get("command", []) + container.get("args", [])


def test_corral_up_passes_quantization_as_a_pod_does() -> None:
    from corral_operator.local import local_fleets

    raw = valid_spec()
    raw["engine"]["args"] = {"quantization": "int8"}
    doc = {
        "apiVersion": "corral.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "q"},
        "spec": raw,
    }
    (fleet,) = local_fleets(json.dumps(doc))
    flags = fleet.engine_args.to_cli_args()
    assert flags[flags.index("--quantization") + 1] == "int8"


def test_the_crd_lists_the_quantizations_the_engine_takes() -> None:
    from corral_operator import crd

    args = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = args["properties"]["engine"]["properties"]["args"]["properties"]["quantization"]
    # int8 and fp8 quantize at load; awq, gptq and compressed-tensors name an int4 checkpoint's format.
    assert field["type"] == "string" and field["enum"] == ["fp8", "int8", "awq", "gptq", "compressed-tensors"]


@pytest.mark.parametrize("kind", ["corral", "vllm"])
def test_the_kv_cache_dtype_reaches_both_engines(kind: str) -> None:
    raw = valid_spec()
    raw["engine"] = {"kind": kind, "image": "engine:test", "args": {"kvCacheDtype": "fp8"}}
    container = render.engine_container(parse_spec(raw))
    argv = container.get("command", []) + container.get("args", [])
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    raw["engine"]["args"] = {"kvCacheDtype": "int8"}
    with pytest.raises(SpecError, match="kvCacheDtype"):
        parse_spec(raw)
    raw["engine"]["args"] = {}  # unset: the model's dtype, and no flag
    container = render.engine_container(parse_spec(raw))
    assert "--kv-cache-dtype" not in container.get("command", []) + container.get("args", [])


def test_a_speculative_setting_the_engine_refuses_is_a_spec_error() -> None:
    raw = valid_spec()
    raw["engine"]["args"] = {"speculative": {"promptLookupMin": 5}}  # above the default max of 3
    with pytest.raises(SpecError, match="prompt_lookup_min"):
        render.engine_container(parse_spec(raw))


def test_pod_overrides_and_scheduling_reach_the_pod() -> None:
    raw = valid_spec()
    raw["pod"] = {
        "env": [{"name": "HF_HOME", "value": "/cache"}, {"name": "X", "value": "1"}],
        "annotations": {"a": "b"},
        "labels": {"team": "ml"},
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
    }
    raw["nodeSelector"] = {"gpu": "a100"}
    raw["tolerations"] = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    raw["rollout"] = {"maxSurge": "25%", "maxUnavailable": 1}
    dep = render.deployment(OWNER, parse_spec(raw))
    template = dep["spec"]["template"]
    env = template["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "HF_HOME"] == [{"name": "HF_HOME", "value": "/cache"}]
    assert template["metadata"]["annotations"] == {"a": "b"}
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["spec"]["nodeSelector"] == {"gpu": "a100"}
    assert template["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 1}
    assert {"name": "cache", "mountPath": "/cache"} in template["spec"]["containers"][0]["volumeMounts"]


def test_affinity_and_spread_reach_the_pod_exactly_as_written() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "a100"]}]}
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 10,
                    "preference": {"matchFields": [{"key": "metadata.name", "operator": "Exists"}]},
                }
            ],
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]},
                        "matchLabelKeys": ["pod-template-hash"],
                    },
                }
            ]
        },
    }
    spread = {
        "maxSkew": 2,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"team": "ml"}},
        "nodeTaintsPolicy": "Honor",
    }
    raw = valid_spec() | {"affinity": affinity, "pod": {"topologySpreadConstraints": [spread]}}
    pod = render.deployment(OWNER, parse_spec(raw))["spec"]["template"]["spec"]
    assert pod["affinity"] == affinity  # nothing added: an empty labelSelector would match every pod
    assert pod["topologySpreadConstraints"] == [spread]


def test_service_targets_the_named_port() -> None:
    svc = render.service(OWNER, _spec())
    assert svc["spec"]["selector"] == labels.selector("tiny")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert render.endpoint_url(OWNER, _spec()) == "http://tiny.ml.svc:8000"


def test_pod_escape_hatches_reach_the_pod_and_merge_over_the_defaults() -> None:
    raw = valid_spec()
    raw["pod"] = {
        "imagePullSecrets": ["regcred"],
        "envFrom": [{"secretRef": {"name": "hf-token"}}],
        "runtimeClassName": "nvidia",
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
        ],
        "securityContext": {"runAsUser": 2000, "fsGroup": 2000},
        "containerSecurityContext": {"readOnlyRootFilesystem": False},
        "probes": {"startup": {"failureThreshold": 1440}, "liveness": {"timeoutSeconds": 10}},
        "annotations": {"sidecar.istio.io/inject": "true"},
    }
    template = render.deployment(OWNER, parse_spec(raw))["spec"]["template"]
    pod = template["spec"]
    (container,) = pod["containers"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["runtimeClassName"] == "nvidia"
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"] == {"matchLabels": labels.selector(OWNER.name)}
    assert spread["maxSkew"] == 1
    assert container["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsNonRoot"]) == (2000, True)
    assert container["securityContext"]["readOnlyRootFilesystem"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert (startup["failureThreshold"], startup["periodSeconds"]) == (1440, 5)
    assert (liveness["timeoutSeconds"], liveness["httpGet"]["path"]) == (10, "/health")
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "true"}


def test_defaults_leave_the_pod_as_before_and_run_as_the_images_user() -> None:
    pod = render.deployment(OWNER, parse_spec(valid_spec()))["spec"]["template"]["spec"]
    for key in ("imagePullSecrets", "runtimeClassName", "topologySpreadConstraints"):
        assert key not in pod
    assert "envFrom" not in pod["containers"][0]
    assert pod["securityContext"]["runAsUser"] == 10001  # USER in docker/engine.Dockerfile
    assert "dshm" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize("kind", ["corral", "vllm"])
def test_gpu_pods_get_shared_memory_and_span_their_gpus(kind: str) -> None:
    raw = valid_spec()
    raw["engine"] = {"kind": kind, "image": "engine:test"}
    raw["resources"] = {"gpu": 4}
    raw["pod"] = {"shmSize": "16Gi"}
    dep = render.deployment(OWNER, parse_spec(raw))
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    argv = pod["containers"][0].get("args", []) + pod["containers"][0].get("command", [])
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"  # vLLM's flag, and the bundled engine's
    raw["engine"]["extraArgs"] = ["--tensor-parallel-size=2", "--pipeline-parallel-size=2"]
    args = render.engine_container(parse_spec(raw)).get("args", [])
    assert "--tensor-parallel-size" not in args  # the user's own split wins


def test_hpa_targets_the_scale_subresource_with_per_pod_engine_metrics() -> None:
    auto = {"mode": "hpa", "minReplicas": 2, "maxReplicas": 9, "targetWaitingPerReplica": 4}
    auto |= {"targetKvUsage": 0.75, "scaleDownStabilizationSeconds": 120}
    objects = render.desired_objects(OWNER, _spec(autoscaling=auto), crds=())
    hpa = next(o for o in objects if o["kind"] == "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "corral.dev/v1alpha1",
        "kind": "LLMDeployment",
        "name": "tiny",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 9)
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert targets["vllm_num_requests_waiting"] == {"type": "AverageValue", "averageValue": "4"}
    assert targets["vllm_kv_cache_usage_perc"] == {"type": "AverageValue", "averageValue": "750m"}
    assert hpa["spec"]["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 120}


def test_scaled_object_queries_this_models_engines_and_the_gateway_queue() -> None:
    auto = {"mode": "keda", "minReplicas": 0, "maxReplicas": 3, "prometheusUrl": "http://prom.mon:9090"}
    auto |= {"scaleToZeroIdleSeconds": 900}
    spec = _spec(autoscaling=auto)
    assert "ScaledObject" not in [o["kind"] for o in render.desired_objects(OWNER, spec, crds=())]
    objects = render.desired_objects(OWNER, spec, crds={"scaledobjects.keda.sh"})
    scaled = next(o for o in objects if o["kind"] == "ScaledObject")
    body = scaled["spec"]
    assert (body["minReplicaCount"], body["maxReplicaCount"], body["cooldownPeriod"]) == (0, 3, 900)
    assert body["scaleTargetRef"]["kind"] == "LLMDeployment"
    triggers = {t["name"]: t for t in body["triggers"]}
    assert {t["metadata"]["serverAddress"] for t in triggers.values()} == {"http://prom.mon:9090"}
    waiting = triggers["waiting"]["metadata"]["query"]
    assert waiting == (
        'sum(max by (instance) (vllm:num_requests_waiting{namespace="ml",app_kubernetes_io_instance="tiny"}))'
        " or vector(0)"
    )
    assert triggers["kv-usage"]["metricType"] == "Value"
    gateway = triggers["gateway-queue"]["metadata"]
    # the gateway's pool is the bare name, or ml/tiny-llama when other namespaces serve tiny-llama too
    assert gateway["query"] == (
        'sum(corral_gateway_queue_length{model="tiny-llama"}'
        ' or corral_gateway_queue_length{model="ml/tiny-llama"}) or vector(0)'
    )
    assert gateway["activationThreshold"] == "0"


def _uri_spec(uri: str, kind: str = "corral", **model: object):
    raw = valid_spec()
    raw["model"] = {"name": "org/m", "uri": uri, **model}
    raw["engine"] = {"kind": kind, "image": "engine:test"}
    if kind == "vllm":
        raw["engine"]["image"] = "vllm/vllm-openai:v0.11.0"
    return parse_spec(raw)


def test_hf_model_is_fetched_by_an_init_container_into_the_cache_the_engine_reads() -> None:
    spec = _uri_spec("hf://org/m@v1", credentialsSecret="hf-token", cache={"sizeLimit": "40Gi"})
    pod = render.deployment(OWNER, spec)["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert fetch["name"] == "fetch-model" and fetch["image"] == "engine:test"
    assert fetch["command"] == ["corral", "fetch-model", "hf://org/m@v1", "--cache-dir", "/models-cache"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} in fetch["env"]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert "nvidia.com/gpu" not in fetch["resources"]["limits"]
    # the secret reaches the download only; the engine loads the complete entry offline
    assert "envFrom" not in engine
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in engine["env"]
    command = engine["command"]
    assert command[command.index("--model") + 1] == "hf://org/m@v1"
    assert command[command.index("--model-cache-dir") + 1] == "/models-cache"
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/models-cache"} in engine["volumeMounts"]


def test_s3_model_on_vllm_reads_the_cache_entry_directory_and_shares_a_cache_claim() -> None:
    spec = _uri_spec(
        "s3://bucket/llama/8b",
        kind="vllm",
        s3Endpoint="http://minio.storage:9000",
        cache={"claimName": "model-cache"},
        fetcherImage="corral-engine:test",
    )
    pod = render.deployment(OWNER, spec)["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert fetch["image"] == "corral-engine:test"
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models-cache/s3/minio.storage_9000/bucket/llama/8b"
    endpoint = {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"}
    assert endpoint in fetch["env"] and endpoint in pod["containers"][0]["env"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in pod["volumes"]
    assert spec.model.claims == ["model-cache"]


def test_pvc_uri_is_read_in_place_without_an_init_container() -> None:
    for kind, expected in (("corral", "pvc://weights/llama/8b"), ("vllm", "/mnt/pvc/weights/llama/8b")):
        spec = _uri_spec("pvc://weights/llama/8b", kind=kind)
        pod = render.deployment(OWNER, spec)["spec"]["template"]["spec"]
        assert "initContainers" not in pod
        argv = pod["containers"][0].get("command", []) + pod["containers"][0].get("args", [])
        assert argv[argv.index("--model") + 1] == expected
        claim = {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
        assert claim in pod["volumes"]
        mount = {"name": "model", "mountPath": "/mnt/pvc/weights", "readOnly": True}
        assert mount in pod["containers"][0]["volumeMounts"]
        assert spec.model.claims == ["weights"]


def test_status_reports_the_tensor_parallel_size_the_pods_run() -> None:
    from corral_operator.engine_command import tensor_parallel_size

    raw = valid_spec()
    assert tensor_parallel_size(parse_spec(raw)) == 1
    raw["resources"] = {"gpu": 4}
    assert tensor_parallel_size(parse_spec(raw)) == 4
    for extra in (["--tensor-parallel-size=2"], ["--tensor-parallel-size", "2"], ["-tp", "2"]):
        raw["engine"] = {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0", "extraArgs": extra}
        assert tensor_parallel_size(parse_spec(raw)) == 2


@pytest.mark.parametrize(
    ("replicas", "bounds", "expected"),
    [(8, (1, 2), 2), (1, (3, 5), 3), (0, (1, 2), 0), (4, (1, 6), 4), (9, None, 9)],
)
def test_replicas_are_rendered_inside_the_autoscaling_bounds(
    replicas: int, bounds: tuple[int, int] | None, expected: int
) -> None:
    auto = {"minReplicas": bounds[0], "maxReplicas": bounds[1]} if bounds else None
    spec = _spec(replicas=replicas, **({"autoscaling": auto} if auto else {}))
    assert render.deployment(OWNER, spec)["spec"]["replicas"] == expected
    kinds = [o["kind"] for o in render.desired_objects(OWNER, spec, crds=())]
    assert "PodDisruptionBudget" in kinds  # at every size: no delete and recreate as replicas move


def test_the_reserved_volume_names_and_mount_paths_cover_what_the_operator_renders() -> None:
    from corral_operator.pod_spec import RESERVED_MOUNT_PATHS, RESERVED_VOLUME_NAMES, RESERVED_VOLUME_PREFIX

    hub = valid_spec()
    hub["model"] = {"name": "m", "uri": "hf://org/m"}
    hub["resources"] = {"gpu": 1}
    with_adapters = valid_spec()  # a volume's model, an adapter through the cache, one on a claim
    with_adapters["adapters"] = [{"name": "a", "uri": "hf://org/a"}, {"name": "b", "uri": "pvc://loras/b"}]
    for raw in (valid_spec(), hub, with_adapters):
        pod = render.deployment(OWNER, parse_spec(raw))["spec"]["template"]["spec"]
        names = {v["name"] for v in pod["volumes"]}
        assert {n for n in names if not n.startswith(RESERVED_VOLUME_PREFIX)} <= set(RESERVED_VOLUME_NAMES)
        if raw is with_adapters:
            assert "adapters-1" in names and "model-cache" in names
            continue  # pvc:// claims mount under /mnt/pvc, as a pvc:// model's does
        mounts = [m for c in pod["containers"] + pod.get("initContainers", []) for m in c["volumeMounts"]]
        assert {m["mountPath"] for m in mounts} <= set(RESERVED_MOUNT_PATHS)


def test_env_from_renders_only_what_is_set() -> None:
    pod = {"envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "APP_"}, {"secretRef": {"name": "s"}}]}
    container = render.engine_container(_spec(pod=pod))
    assert container["envFrom"] == [
        {"prefix": "APP_", "configMapRef": {"name": "cfg"}},
        {"secretRef": {"name": "s"}},
    ]


def test_service_monitors_carry_the_labels_prometheus_selects_by() -> None:
    objects = render.desired_objects(
        OWNER,
        _spec(),
        crds={render.SERVICE_MONITOR_CRD},
        monitor_labels={"release": "kube-prometheus-stack", "app.kubernetes.io/name": "not-ours"},
    )
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    labels_ = monitor["metadata"]["labels"]
    assert labels_["release"] == "kube-prometheus-stack"
    assert labels_["app.kubernetes.io/name"] != "not-ours"  # the operator's own labels win
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert "release" not in deployment["metadata"]["labels"]


def test_service_monitors_scrape_at_the_operators_interval() -> None:
    objects = render.desired_objects(OWNER, _spec(), crds={render.SERVICE_MONITOR_CRD}, monitor_interval="1m")
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert [e["interval"] for e in monitor["spec"]["endpoints"]] == ["1m"]


def test_two_deployments_of_one_model_scale_on_their_own_pods_load() -> None:
    """KEDA's engine triggers select this LLMDeployment's pods by the label its ServiceMonitor copies
    onto every series, not by the model name another LLMDeployment in the namespace may share."""
    auto = {"mode": "keda", "minReplicas": 0, "maxReplicas": 3, "prometheusUrl": "http://prom.mon:9090"}
    spec = _spec(autoscaling=auto)
    crds = {"scaledobjects.keda.sh", render.SERVICE_MONITOR_CRD}
    queries = {}
    for owner in (OWNER, render.Owner(name="tiny-canary", namespace="ml", uid="uid-456")):
        objects = {o["kind"]: o for o in render.desired_objects(owner, spec, crds=crds)}
        triggers = {t["name"]: t["metadata"]["query"] for t in objects["ScaledObject"]["spec"]["triggers"]}
        queries[owner.name] = triggers
        monitor = objects["ServiceMonitor"]["spec"]
        assert monitor["podTargetLabels"] == [labels.INSTANCE]
        pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
        assert pod_labels[labels.INSTANCE] == owner.name
        for name in ("waiting", "kv-usage"):
            assert f'app_kubernetes_io_instance="{owner.name}"' in triggers[name]
            assert "model_name" not in triggers[name]
    assert queries["tiny"]["waiting"] != queries["tiny-canary"]["waiting"]
