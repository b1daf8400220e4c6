"""A simulated replica of a vision-language checkpoint (the demo LLaVA) takes images as the engine
does: the same prompt token counts, prefix-cache hits, tower runs and refusals as the real engine
serving the same checkpoint; a step that embeds images lasts the vision tower's roofline longer."""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import io
import math
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
from corral_cli.simulate import replica_spec
from corral_engine import AsyncEngine, EngineArgs
from corral_engine.demo_llava import VISION, write_llava_model
from corral_engine.demo_qwen_vl import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, write_qwen_vl_model
from corral_engine.errors import ModelLoadError
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import create_app
from corral_engine.sim.async_engine import AsyncSimEngine
from corral_engine.sim.engine import SimEngine
from corral_engine.sim.host import build_engines, replica_app
from corral_engine.sim.perf_model import BUILTIN, H100
from corral_engine.sim.tokenizer import LightTokenizer
from corral_engine.sim.vision import sim_vision
from corral_engine.sim.vision_cost import QwenTowerShape, TowerShape, vision_cost
from corral_engine.vision_config import LlavaVisionConfig
from PIL import Image

NUM_IMAGE_TOKENS = 16  # the demo's 32x32 images in 8x8 patches
IMAGE_TOKEN_ID = 3


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_llava_model(tmp_path_factory.mktemp("llava") / "m")


def _png(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _image(seed: int, size: tuple[int, int] = (40, 50)) -> dict[str, Any]:
    url = f"data:image/png;base64,{base64.b64encode(_png(seed, size)).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(*turns: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat of user turns (each its content parts), answered by earlier assistant turns."""
    messages: list[dict[str, Any]] = []
    for content in turns:
        if messages:
            messages.append({"role": "assistant", "content": "A picture."})
        messages.append({"role": "user", "content": content})
    return {"model": "m", "max_tokens": 4, "temperature": 0.0, "messages": messages}


def _sim_engine(llava_dir: pathlib.Path, **args: Any) -> AsyncSimEngine:
    spec = replica_spec(
        argparse.Namespace(simulate="h100-llama3-8b"), EngineArgs(model=str(llava_dir), **args)
    )
    [engine] = build_engines(spec, 1)
    return engine


@contextlib.asynccontextmanager
async def _served(engine: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client


@contextlib.asynccontextmanager
async def _sim_and_real(
    llava_dir: pathlib.Path, **args: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, AsyncSimEngine, AsyncEngine]]:
    """Clients of a simulated replica and of the real engine (float32, on CPU) of the checkpoint,
    both given the engine arguments `args`."""
    sim = _sim_engine(llava_dir, **args)
    real = AsyncEngine(EngineArgs(model=str(llava_dir), dtype="float32", num_kv_blocks=256, **args))
    async with _served(sim) as sim_client, _served(real) as real_client:
        yield sim_client, real_client, sim, real


async def test_image_chats_count_prompts_cache_and_refuse_as_the_engine(llava_dir: pathlib.Path) -> None:
    """Three images in two user turns: the real engine's prompt_tokens (each image's 16 placeholder
    tokens expanded by the checkpoint's processor); the same image again is found in the prefix
    cache (its blocks keyed by the image's hash), another image is not, and the vision tower runs
    as often as the engine's; one image past --max-images-per-prompt is the engine's 400."""
    three = _chat([{"type": "text", "text": "What is this?"}, _image(1)], [_image(2), _image(3)])
    one = _chat([{"type": "text", "text": "Look at"}, _image(4), {"type": "text", "text": "now"}])
    other = _chat([{"type": "text", "text": "Look at"}, _image(5), {"type": "text", "text": "now"}])
    seen: dict[str, list[Any]] = {}
    async with _sim_and_real(llava_dir, max_images_per_prompt=3) as (sim_client, real_client, sim, real):
        for name, client in (("sim", sim_client), ("real", real_client)):
            replies = [
                await client.post("/v1/chat/completions", json=body) for body in (three, one, one, other)
            ]
            assert [r.status_code for r in replies] == [200] * 4, replies[0].text
            too_many = _chat([_image(1), _image(2), _image(3), _image(4)])
            refused = await client.post("/v1/chat/completions", json=too_many)
            seen[name] = [
                [r.json()["usage"]["prompt_tokens"] for r in replies],
                (refused.status_code, refused.json()),
                (await client.get("/metrics")).text,
            ]
        assert sim.engine.image_steps is not None and real.engine.runner.images is not None
        num_tower_runs = (
            sim.engine.image_steps.num_images_embedded,
            real.engine.runner.images.num_images_embedded,
        )
    assert seen["sim"][:2] == seen["real"][:2]
    num_prompt = seen["sim"][0]
    assert num_prompt[0] > 3 * NUM_IMAGE_TOKENS and num_prompt[1] == num_prompt[2] == num_prompt[3]
    status, error = seen["sim"][1]
    assert status == 400 and error["error"]["param"] == "messages[0].content[3].image_url"
    assert "at most 3" in error["error"]["message"]
    # 3 + 1 + 0 (the same image, cached) + 1 (another image at the same place): as the engine's.
    assert num_tower_runs == (5, 5)
    hits = [_counter(seen[name][2], "vllm:prefix_cache_hits_total") for name in ("sim", "real")]
    assert hits[0] == hits[1] >= NUM_IMAGE_TOKENS


def _counter(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name))
    return float(line.rsplit(" ", 1)[1])


async def test_allowed_media_domains_and_a_text_only_checkpoint_refuse_as_the_engine(
    llava_dir: pathlib.Path, tiny_model_dir: pathlib.Path
) -> None:
    """An http image URL of a host off --allowed-media-domains is the engine's 400 before any fetch;
    a text checkpoint's replica refuses image parts as a text-only model, the engine's 400."""
    body = _chat([{"type": "image_url", "image_url": {"url": "http://images.invalid/a.png"}}])
    async with _served(_sim_engine(llava_dir, allowed_media_domains=("127.0.0.1",))) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "messages[0].content[0].image_url"
    assert "--allowed-media-domains" in error["message"]
    [text_only] = build_engines(
        replica_spec(argparse.Namespace(simulate="h100-llama3-8b"), EngineArgs(model=str(tiny_model_dir))), 1
    )
    async with _served(text_only) as client:
        resp = await client.post(
            "/v1/chat/completions", json={**_chat([_image(1)]), "model": tiny_model_dir.name}
        )
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "messages[0].content[0].image_url"
    assert f"{tiny_model_dir.name} is a text-only model" in error["message"]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
async def test_a_qwen_vl_replica_counts_as_the_engine_and_costs_each_image_by_its_grid(
    tmp_path: pathlib.Path, arch: str
) -> None:
    """Images of two sizes: the real engine's prompt_tokens (each image's merged patches); the
    tower's FLOPs follow each image's grid (Qwen2.5-VL's windowed layers attend within 16
    patches), and a step embedding an image adds that image's roofline time."""
    model = write_qwen_vl_model(tmp_path / arch / "m", arch=arch)  # served as m
    body = _chat([{"type": "text", "text": "What is this?"}, _image(1)], [_image(2, (64, 24))])
    async with _sim_and_real(model) as (sim_client, real_client, sim, _):
        replies = [await c.post("/v1/chat/completions", json=body) for c in (sim_client, real_client)]
        assert [r.status_code for r in replies] == [200, 200], replies[0].text
        assert replies[0].json()["usage"]["prompt_tokens"] == replies[1].json()["usage"]["prompt_tokens"]
        image_steps = sim.engine.image_steps
        assert image_steps is not None and image_steps.num_images_embedded == 2
    vision = sim_vision(model, max_images=4)
    assert vision is not None
    cost = vision_cost(BUILTIN["h100-llama3-8b"], vision.config)
    tower = cost.tower
    assert isinstance(tower, QwenTowerShape)
    d, text = 32, vision.config.out_hidden_size
    inter, num_mlp, num_full, window = (64, 2, 3, 0) if arch == "qwen2_vl" else (48, 3, 2, 16)
    layer, patch, merger = 4 * d * d + num_mlp * d * inter, 3 * 2 * 4 * 4 * d, (4 * d) ** 2 + 4 * d * text
    assert tower.num_params == patch + tower.num_layers * layer + merger
    n = 8 * 12  # a (1, 8, 12) grid: 96 patches, 24 merged rows
    windowed = (tower.num_layers - num_full) * (2 * n * layer + 4 * n * window * d)
    flops = 2 * n * patch + num_full * (2 * n * layer + 4 * n * n * d) + windowed + 2 * (n // 4) * merger
    assert tower.flops((1, 8, 12)) == flops
    assert tower.flops((1, 16, 12)) > 2 * tower.flops((1, 8, 12))  # attention grows faster
    # A step embedding an image adds its grid's time.
    tokenizer = LightTokenizer(model)
    ids = [*tokenizer.encode("one two three"), VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID]
    expanded, images = vision.images.build(ids, [Image.open(io.BytesIO(_png(1)))])
    grid = images[0].grid_thw
    assert grid is not None and images[0].length == math.prod(grid) // 4
    engine = SimEngine(BUILTIN["h100-llama3-8b"], tokenizer, "m", vision=vision)
    engine.insert_request(engine.make_request("r", expanded, SamplingParams(max_tokens=1), mm_inputs=images))
    step = engine.begin_step()
    assert step is not None and step.vision_s == pytest.approx(cost.step_time_s([grid]))
    assert step.vision_s > 0.0


def test_what_the_engine_refuses_for_a_vision_model_the_simulator_refuses(llava_dir: pathlib.Path) -> None:
    namespace = argparse.Namespace(simulate="h100-llama3-8b")
    for args, flag in (({"enable_lora": True}, "--enable-lora"), ({"runner": "pooling"}, "--runner pooling")):
        with pytest.raises(ModelLoadError, match=f"{flag}: not supported with a vision-language model"):
            replica_spec(namespace, EngineArgs(model=str(llava_dir), **args))


# CLIP ViT-L/14 at 336 px (LLaVA-1.5's tower): 24 layers of 1,024, MLP 4,096, the second-to-last
# layer's features without the class position.
CLIP_L_336 = LlavaVisionConfig(
    336,
    14,
    3,
    1024,
    4096,
    24,
    16,
    1e-5,
    "quick_gelu",
    (-2,),
    "default",
    "gelu",
    True,
    32000,
    "LlamaForCausalLM",
)


def test_the_tower_roofline_of_llava_1_5_into_llama3_8b() -> None:
    """576 patches through 23 layers (the 24th is never read) and a projector into 4,096: 311 M
    parameters, ~389 GFLOP an image; compute-bound on an H100 from the first image."""
    tower = TowerShape.of(CLIP_L_336, 4096)
    layer = 4 * 1024**2 + 2 * 1024 * 4096
    projector = 1024 * 4096 + 4096**2
    assert tower.num_layers == 23 and tower.num_patches == 576 and tower.num_image_tokens == 576
    assert tower.num_params == 3 * 14 * 14 * 1024 + 23 * layer + projector
    flops = 2 * 576 * 3 * 14 * 14 * 1024 + 23 * (2 * 577 * layer + 4 * 577**2 * 1024) + 2 * 576 * projector
    assert tower.flops_per_image == flops
    cost = vision_cost(BUILTIN["h100-llama3-8b"], CLIP_L_336)
    assert cost.step_time_s([]) == 0.0
    assert cost.step_time_s([None]) == pytest.approx(flops / (0.6 * H100.peak_flops))  # ~0.66 ms
    assert cost.step_time_s([None] * 4) == pytest.approx(4 * cost.step_time_s([None]))
    # Four GPUs share the tower as they share the text model's matmuls.
    flops_70b = TowerShape.of(CLIP_L_336, 8192).flops_per_image
    assert vision_cost(BUILTIN["h100-llama3-70b"], CLIP_L_336).step_time_s([None] * 4) == pytest.approx(
        4 * flops_70b / (4 * 0.6 * H100.peak_flops)
    )
    # A fitted profile has no GPU: the tower is costed on one H100 projecting into Llama-3-8B.
    assert vision_cost(BUILTIN["h100-llama3-8b-corral"], CLIP_L_336) == cost


def _demo_tower_s(num_images: int) -> float:
    """The demo tower (2 of its 3 layers of 32 run, 16 patches of 8x8x3) projecting into
    h100-llama3-8b's 4,096, by the formula of docs/simulator.md."""
    d, i, p, t, dt = VISION["hidden_size"], VISION["intermediate_size"], 16, 17, 4096
    layer, patch, projector = 4 * d * d + 2 * d * i, 3 * 8 * 8 * d, d * dt + dt * dt
    params = patch + 2 * layer + projector
    flops = 2 * p * patch + 2 * (2 * t * layer + 4 * t * t * d) + 2 * p * projector
    compute_s = num_images * flops / (0.6 * H100.peak_flops)
    return max(compute_s, 2 * params / (0.85 * H100.memory_bandwidth_bytes_s))


def test_a_step_embedding_images_takes_the_tower_s_time_longer(llava_dir: pathlib.Path) -> None:
    """The same prompt ids with and without their images: the steps that embed images last the
    tower's time longer; a chunked image is embedded once, at its first chunk, as the engine does."""
    profile = BUILTIN["h100-llama3-8b"]
    vision = sim_vision(llava_dir, max_images=4)
    assert vision is not None
    tokenizer = LightTokenizer(llava_dir)
    text = tokenizer.encode("one two three four five six seven eight nine ten")
    ids = [*text, IMAGE_TOKEN_ID, *text, IMAGE_TOKEN_ID]
    pil = [Image.open(io.BytesIO(_png(seed))) for seed in (1, 2)]
    expanded, images = vision.images.build(ids, pil)
    assert len(expanded) == len(ids) + 2 * (NUM_IMAGE_TOKENS - 1)

    def steps(chunk: int, with_images: bool) -> list[tuple[float, float]]:
        engine = SimEngine(
            dataclasses.replace(profile, max_num_batched_tokens=chunk),
            tokenizer,
            "m",
            vision=vision if with_images else None,
        )
        request = engine.make_request(
            "r", expanded, SamplingParams(max_tokens=2), mm_inputs=images if with_images else None
        )
        engine.insert_request(request)
        out = []
        while (step := engine.begin_step()) is not None:
            out.append((step.duration_s, step.vision_s))
            engine.finish_step(step)
        return out

    whole, plain = steps(8192, True), steps(8192, False)
    assert whole[0][0] - plain[0][0] == pytest.approx(_demo_tower_s(2)) == whole[0][1]
    assert whole[1:] == plain[1:] and all(v == 0.0 for _, v in whole[1:])  # decode steps embed nothing
    # Chunks of 16: the first image spans chunks 1-2 (embedded at 1), the second chunks 3-4 (at 3).
    chunked, plain = steps(16, True), steps(16, False)
    added = [a - b for (a, _), (b, _) in zip(chunked, plain, strict=True)]
    first, second = images[0].offset // 16, images[1].offset // 16
    assert first != second and images[0].end > 16 * (first + 1)  # each image spans two chunks
    tower_1 = pytest.approx(_demo_tower_s(1))
    assert added[first] == tower_1 and added[second] == tower_1
    assert all(added[k] == 0.0 for k in range(len(added)) if k not in (first, second))


async def test_a_fleet_of_replicas_shares_one_image_processor(llava_dir: pathlib.Path) -> None:
    spec = replica_spec(argparse.Namespace(simulate="h100-llama3-8b"), EngineArgs(model=str(llava_dir)))
    engines = build_engines(spec, 3)
    assert spec.vision is not None and all(e.images is spec.vision.images for e in engines)
    app = replica_app(engines[1], spec)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            resp = await client.post("/v1/chat/completions", json=_chat([_image(7)]))
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] > NUM_IMAGE_TOKENS
