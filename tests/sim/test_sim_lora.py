"""LoRA adapters on a simulated replica: the engine's flags, each adapter's config read and
checked (no weights), the adapters listed and named by requests, and vLLM's LoRA gauge, so the
gateway's fleet tests can route adapters to simulated replicas. No torch."""

from __future__ import annotations

import argparse
import json
import pathlib

import httpx
import pytest
from corral_cli import cmd_engine
from corral_cli.simulate import replica_spec
from corral_engine import wire
from corral_engine.lora import AdapterError
from corral_engine.sim.host import build_engines, replica_app
from prometheus_client.parser import text_string_to_metric_families


def _adapter(root: pathlib.Path, name: str, rank: int = 8) -> pathlib.Path:
    path = root / name
    path.mkdir()
    config = {"r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _spec(model_dir: pathlib.Path, *flags: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--simulate", "h100-llama3-8b", *flags])
    return replica_spec(args, cmd_engine.engine_args_from(args))


async def test_simulated_replica_lists_adapters_and_reports_them(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    sql, chat = _adapter(tmp_path, "sql"), _adapter(tmp_path, "chat", rank=4)
    spec = _spec(
        tiny_model_dir,
        "--served-model-name", "sim", "--enable-lora", "--lora-modules", f"sql={sql}", f"chat={chat}",
        "--max-loras", "1", "--allow-runtime-lora-updating",
    )  # fmt: skip
    [engine] = build_engines(spec, 1)
    app = replica_app(engine, spec)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
            assert models["sql"]["parent"] == "sim" and models["chat"]["root"] == str(chat)
            for model in ("sql", "chat", "sim"):
                body = {"model": model, "prompt": "one two three", "max_tokens": 3}
                reply = await client.post("/v1/completions", json=body)
                assert reply.status_code == 200 and reply.json()["model"] == model
            load = {"lora_name": "late", "lora_path": str(_adapter(tmp_path, "late"))}
            assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 200
            too_big = {"lora_name": "big", "lora_path": str(_adapter(tmp_path, "big", rank=64))}
            assert (await client.post("/v1/load_lora_adapter", json=too_big)).status_code == 400
            text = (await client.get("/metrics")).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == wire.LORA_REQUESTS_INFO]
    (sample,) = family.samples
    assert sample.labels[wire.LORA_MAX_LABEL] == "1" and sample.value > 0


def test_a_bad_adapter_config_is_refused_before_serving(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = _adapter(tmp_path, "big", rank=32)
    with pytest.raises(AdapterError, match=r"adapter 'big'.*rank 32 is larger than --max-lora-rank 16"):
        _spec(tiny_model_dir, "--enable-lora", "--lora-modules", f"big={big}")
    spec = _spec(tiny_model_dir)
    assert spec.max_loras == 0 and spec.adapters == ()  # LoRA off: no gauge, no adapters
    assert not _spec(tiny_model_dir, "--enable-lora").allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")  # vLLM's switch turns the endpoints on
    assert _spec(tiny_model_dir, "--enable-lora").allow_runtime_lora_updating
