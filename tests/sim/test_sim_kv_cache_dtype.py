"""A simulated replica with `--kv-cache-dtype fp8`: a token's keys and values take half of bf16's
bytes, so twice the KV blocks fit in the memory the weights leave and decode steps read less; "auto"
changes nothing; a fitted profile names the flag as one it cannot honour; vllm:cache_config_info
labels the flag's value, as the engine's does."""

from __future__ import annotations

import argparse
import pathlib

import httpx
import pytest
from corral_cli.simulate import replica_spec
from corral_engine import wire
from corral_engine.args import EngineArgs
from corral_engine.server import create_app
from corral_engine.sim.host import build_engines, ignored_options, with_overrides
from corral_engine.sim.perf_model import BUILTIN, Profile, Roofline, StepShape, with_kv_cache_dtype

DECODE_64 = StepShape(64, 64, 64 * 4000, 64 * 4000.0)


@pytest.mark.parametrize("name", ["h100-llama3-8b", "h100-llama3-70b"])
def test_fp8_kv_doubles_the_blocks_and_shortens_long_context_decodes(name: str) -> None:
    base = BUILTIN[name]
    fp8 = with_overrides(base, {"kv_cache_dtype": "fp8"})
    assert isinstance(base.model, Roofline) and isinstance(fp8.model, Roofline)
    assert fp8.model.model.kv_bytes_per_token * 2 == base.model.model.kv_bytes_per_token
    assert fp8.model.model.weight_bytes == base.model.model.weight_bytes
    assert fp8.num_kv_blocks == pytest.approx(2 * base.num_kv_blocks, abs=2)
    assert fp8.step_time_s(DECODE_64) < base.step_time_s(DECODE_64)
    assert fp8.name == f"{name}-kv-fp8"
    # with quantized weights too: both savings
    both = with_overrides(base, {"kv_cache_dtype": "fp8_e4m3", "quantization": "fp8"})
    assert both.num_kv_blocks > fp8.num_kv_blocks


def test_auto_changes_nothing() -> None:
    base = BUILTIN["h100-llama3-8b"]
    assert with_overrides(base, {"kv_cache_dtype": "auto"}) == base
    assert with_kv_cache_dtype(base, "auto") == base
    assert ignored_options(base, {"kv_cache_dtype": "fp8"}) == []


def test_a_fitted_profile_cannot_change_its_kv_dtype() -> None:
    fitted = next(p for p in BUILTIN.values() if not isinstance(p.model, Roofline))
    assert isinstance(fitted, Profile)
    assert "kv_cache_dtype" in ignored_options(fitted, {"kv_cache_dtype": "fp8"})
    assert ignored_options(fitted, {"kv_cache_dtype": "auto"}) == []
    assert with_overrides(fitted, {"kv_cache_dtype": "fp8"}).num_kv_blocks == fitted.num_kv_blocks
    with pytest.raises(ValueError, match="fitted"):
        with_kv_cache_dtype(fitted, "fp8")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
async def test_cache_config_info_labels_the_flags_value(
    tiny_model_dir: pathlib.Path, kv_cache_dtype: str
) -> None:
    args = argparse.Namespace(simulate="h100-llama3-8b", kv_cache_dtype=kv_cache_dtype)
    spec = replica_spec(args, EngineArgs(model=str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype))  # type: ignore[arg-type]
    [engine] = build_engines(spec, 1)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            text = (await c.get("/metrics")).text
    [line] = [line for line in text.splitlines() if line.startswith(wire.CACHE_CONFIG_INFO + "{")]
    assert f'cache_dtype="{kv_cache_dtype}"' in line
    assert f'num_gpu_blocks="{spec.profile.num_kv_blocks}"' in line  # fp8: the doubled count
