"""`spec.adapters`: LoRA adapters fetched beside the model and named to the engine (both kinds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from corral_operator import engine_command, render, status
from corral_operator.local import local_fleet
from corral_operator.spec import SpecError, parse_spec

from tests.operator.invalid_cases import valid_spec

ROOT = Path(__file__).resolve().parents[2]
OWNER = render.Owner(name="llama", namespace="ml", uid="uid-1")
HUB_ADAPTERS = [
    {"name": "sql-lora", "uri": "hf://org/sql-lora@v2"},
    {"name": "org/chat-lora", "uri": "s3://loras/chat"},
]


def _raw(model: dict[str, Any], adapters: list[dict[str, str]], kind: str = "corral") -> dict[str, Any]:
    raw = valid_spec()
    raw["model"] = model
    raw["engine"] = {"kind": kind, "image": "engine:test"}
    if kind == "vllm":
        raw["engine"] = {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"}
        raw["model"] = {**model, "fetcherImage": "corral-engine:test"}
    raw["adapters"] = adapters
    return raw


def _pod(raw: dict[str, Any]) -> dict[str, Any]:
    return render.deployment(OWNER, parse_spec(raw))["spec"]["template"]["spec"]


def _argv(pod: dict[str, Any]) -> list[str]:
    engine = pod["containers"][0]
    return engine.get("command", []) + engine.get("args", [])


def _lora_modules(argv: list[str]) -> list[str]:
    """The NAME=PATH items after --lora-modules, up to the next flag."""
    rest = argv[argv.index("--lora-modules") + 1 :]
    return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


HUB_MODEL = {
    "name": "meta-llama/Llama-3.1-8B",
    "uri": "hf://meta-llama/Llama-3.1-8B",
    "credentialsSecret": "hf",
}
CACHED = [
    "sql-lora=/models-cache/hf/org/sql-lora/v2",
    "org/chat-lora=/models-cache/s3/minio.io_9000/loras/chat",
]


@pytest.mark.parametrize("kind", ["corral", "vllm"])
def test_hub_and_s3_adapters_are_fetched_after_the_model_and_named_to_the_engine(kind: str) -> None:
    model = {**HUB_MODEL, "s3Endpoint": "http://minio.io:9000"}
    pod = _pod(_raw(model, HUB_ADAPTERS, kind))
    names = [c["name"] for c in pod["initContainers"]]
    assert names == ["fetch-model", "fetch-adapter-0", "fetch-adapter-1"]
    model_fetch, sql, chat = pod["initContainers"]
    assert sql["command"] == ["corral", "fetch-model", "hf://org/sql-lora@v2", "--cache-dir", "/models-cache"]
    assert chat["command"][2] == "s3://loras/chat"
    for fetch in (sql, chat):  # the model's credentials, endpoint, image and cache
        assert fetch["envFrom"] == [{"secretRef": {"name": "hf"}}]
        assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio.io:9000"} in fetch["env"]
        assert fetch["image"] == model_fetch["image"]
        assert fetch["volumeMounts"] == model_fetch["volumeMounts"]
        assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    argv = _argv(pod)
    assert "--enable-lora" in argv and argv.index("--enable-lora") < argv.index("--host")
    assert _lora_modules(argv) == CACHED
    assert "--max-loras" not in argv  # unset: the engine's default
    assert "envFrom" not in pod["containers"][0]


@pytest.mark.parametrize("kind", ["corral", "vllm"])
def test_pvc_adapters_are_read_in_place_sharing_the_models_claim(kind: str) -> None:
    adapters = [
        {"name": "a", "uri": "pvc://weights/loras/a"},  # the model's own claim
        {"name": "b", "uri": "pvc://loras/b"},
        {"name": "c", "uri": "pvc://loras/c"},  # the same other claim, mounted once
    ]
    pod = _pod(_raw({"name": "m", "uri": "pvc://weights/llama"}, adapters, kind))
    assert "initContainers" not in pod
    assert _lora_modules(_argv(pod)) == [
        "a=/mnt/pvc/weights/loras/a",
        "b=/mnt/pvc/loras/b",
        "c=/mnt/pvc/loras/c",
    ]
    claims = {v["name"]: v.get("persistentVolumeClaim") for v in pod["volumes"]}
    assert claims["model"] == {"claimName": "weights", "readOnly": True}
    assert claims["adapters-1"] == {"claimName": "loras", "readOnly": True}
    assert len([c for c in claims.values() if c]) == 2
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "adapters-1", "mountPath": "/mnt/pvc/loras", "readOnly": True} in mounts
    assert parse_spec(_raw({"name": "m", "uri": "pvc://weights/llama"}, adapters, kind)).claims == [
        "weights",
        "loras",
    ]


def test_a_model_from_a_volume_gets_the_cache_for_its_hub_adapters() -> None:
    raw = _raw({"name": "m", "source": {"hostPath": {"path": "/models/m"}}, "cache": {"claimName": "c"}}, [])
    raw["adapters"] = [{"name": "sql", "uri": "hf://org/sql"}]
    pod = _pod(raw)
    (fetch,) = pod["initContainers"]
    assert fetch["name"] == "fetch-adapter-0" and fetch["command"][2] == "hf://org/sql"
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "c"}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/models-cache"} in pod["containers"][0]["volumeMounts"]
    argv = _argv(pod)
    assert argv[argv.index("--model") + 1] == "/models"
    assert "--model-cache-dir" not in argv  # the model is not in the cache
    assert _lora_modules(argv) == ["sql=/models-cache/hf/org/sql/main"]
    assert parse_spec(raw).claims == ["c"]


def test_without_adapters_nothing_changes() -> None:
    for kind in ("corral", "vllm"):
        pod = _pod(_raw(HUB_MODEL, [], kind))
        assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]
        assert "--enable-lora" not in _argv(pod) and "--lora-modules" not in _argv(pod)
        assert not any(v["name"].startswith("adapters-") for v in pod["volumes"])


def test_a_path_vllm_would_split_wrongly_goes_in_the_json_form() -> None:
    adapters = [{"name": "a", "uri": "s3://loras/dt=2024/a"}, {"name": "b", "uri": "pvc://loras/b,c"}]
    argv = _argv(_pod(_raw({"name": "m", "uri": "pvc://weights/m"}, adapters, "vllm")))
    assert [json.loads(m) for m in _lora_modules(argv)] == [
        {"name": "a", "path": "/models-cache/s3/aws/loras/dt=2024/a"},
        {"name": "b", "path": "/mnt/pvc/loras/b,c"},
    ]


def test_changing_the_adapters_changes_the_pod_template() -> None:
    before = render.deployment(OWNER, parse_spec(_raw(HUB_MODEL, HUB_ADAPTERS[:1])))
    after = render.deployment(OWNER, parse_spec(_raw(HUB_MODEL, HUB_ADAPTERS)))
    assert before["spec"]["template"] != after["spec"]["template"]


def test_the_pydantic_model_refuses_what_the_uri_parser_refuses() -> None:
    with pytest.raises(SpecError, match=r"spec\.adapters\.0.*adapters sql: uri: hf:// URIs are"):
        parse_spec(_raw(HUB_MODEL, [{"name": "sql", "uri": "hf://a/b/c"}]))


def _init_status(name: str, state: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "llama-0"},
        "status": {"initContainerStatuses": [{"name": name, "state": state}]},
    }


def test_a_failed_adapter_fetch_degrades_with_the_fetchers_reason_and_line() -> None:
    line = "ModelNotFound: hf://org/sql-lora@v2: revision or file not found (404)"
    pod = _init_status("fetch-adapter-0", {"terminated": {"exitCode": 3, "message": f"log\n{line}\n"}})
    reason, message = status.pod_problem([pod]) or ("", "")
    assert reason == "ModelNotFound"
    assert message == f"pod llama-0: cannot fetch an adapter (fetch-adapter-0): {line}"
    running = _init_status("fetch-adapter-1", {"running": {}})
    assert status.fetching([running]) == "pod llama-0: downloading an adapter (fetch-adapter-1)"
    assert (
        status.fetching([_init_status("fetch-model", {"running": {}})])
        == "pod llama-0: downloading the model"
    )


def test_corral_up_takes_hub_and_s3_adapters_and_refuses_pvc_ones_rather_than_dropping_them() -> None:
    doc = {"apiVersion": "corral.dev/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "m"}}
    model = {"name": "m", "source": {"hostPath": {"path": "/models/m"}}, "s3Endpoint": "http://minio:9000"}
    fleet = local_fleet({**doc, "spec": _raw(model, HUB_ADAPTERS)})
    assert fleet.adapters == (("sql-lora", "hf://org/sql-lora@v2"), ("org/chat-lora", "s3://loras/chat"))
    assert fleet.s3_endpoint == "http://minio:9000"  # the adapters are fetched from the model's store
    with pytest.raises(SpecError, match=r"spec\.adapters support-lora: pvc://lora/support is on a PVC"):
        local_fleet({**doc, "spec": _raw(model, [{"name": "support-lora", "uri": "pvc://lora/support"}])})


def test_local_adapter_flags_are_rendered_as_a_pods() -> None:
    """`corral up -f` hands its local directories to the same rendering as the pods' cache paths."""
    assert engine_command.lora_module_flags([("a", "/c/a"), ("b", "/c/dt=1")]) == [
        "--enable-lora",
        "--lora-modules",
        "a=/c/a",
        '{"name": "b", "path": "/c/dt=1"}',
    ]
    assert engine_command.lora_module_flags([]) == []


def test_the_adapters_example_renders_fetchers_and_lora_flags() -> None:
    (doc,) = yaml.safe_load_all((ROOT / "examples" / "llama-with-adapters.yaml").read_text())
    spec = parse_spec(doc["spec"])
    pod = render.deployment(OWNER, spec)["spec"]["template"]["spec"]
    fetchers = [c["name"] for c in pod["initContainers"]]
    assert fetchers[0] == "fetch-model" and len(fetchers) == 1 + sum(a.is_downloaded for a in spec.adapters)
    assert [m.split("=")[0] for m in _lora_modules(_argv(pod))] == [a.name for a in spec.adapters]
