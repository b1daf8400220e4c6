"""Qwen2-VL and Qwen2.5-VL in the engine: greedy float32 tokens equal transformers' `.generate` for
one image, two images of different sizes, a text-only prompt and all of them in one batch, prefill
chunks that split an image, preemption, the engine core in its own process and the hub's older
weight names; M-RoPE positions and the towers' windows as transformers computes them; prefix
caching keyed by image content; the refusals."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch
from corral_engine.demo_qwen_vl import IMAGE_PAD_ID, QWEN_VL_ARCHS, write_qwen_vl_model
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.engine.helpers import cached_and_generated, make_engine, run_checked

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# (text, images as (seed, (height, width))): 40x50 is 30 image tokens, 64x24 is 24, 24x70 is 27.
CASES: list[tuple[str, list[tuple[int, tuple[int, int]]]]] = [
    (_turn(f"Hello, world! {IMAGE} What is in the picture?"), [(1, (40, 50))]),
    (_turn(f"Compare {IMAGE} and {IMAGE} please."), [(2, (40, 50)), (3, (64, 24))]),
    (_turn("The quick brown fox jumps over the lazy dog."), []),
    (_turn(f"{IMAGE}\nOnce upon a time there was a small cat."), [(4, (24, 70))]),
]


@pytest.fixture(scope="module", params=list(QWEN_VL_ARCHS))
def qwen_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_qwen_vl_model(tmp_path_factory.mktemp(request.param) / "m", request.param)


@pytest.fixture(scope="module")
def reference(qwen_dir: pathlib.Path) -> Any:
    """transformers' greedy tokens for (text, images) in float32, its image processor making the
    pixels and grids; each `<|image_pad|>` expanded to its grid's merged count, as its processor
    does (whose constructor wants torchvision, for videos)."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    arch = AutoConfig.from_pretrained(qwen_dir).architectures[0]
    model = getattr(transformers, arch).from_pretrained(qwen_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(qwen_dir, backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)

    done: dict[str, tuple[list[int], list[int]]] = {}

    def greedy(text: str, specs: list[tuple[int, tuple[int, int]]]) -> tuple[list[int], list[int]]:
        key = repr((text, specs))
        if key not in done:
            done[key] = _greedy(text, _images(specs))
        return done[key]

    def _greedy(text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
        kwargs: dict[str, Any] = {}
        if images:
            kwargs = dict(processor(images=images, return_tensors="pt"))
            for grid in kwargs["image_grid_thw"].tolist():
                text = text.replace(
                    "<|image_pad|>", "<|placeholder|>" * (grid[0] * grid[1] * grid[2] // 4), 1
                )
            text = text.replace("<|placeholder|>", "<|image_pad|>")
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        kwargs["mm_token_type_ids"] = (ids == IMAGE_PAD_ID).int()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                **kwargs,
            )
        return ids[0].tolist(), out[0, ids.shape[1] :].tolist()

    return greedy


def _images(specs: list[tuple[int, tuple[int, int]]]) -> list[Image.Image]:
    return [_image(seed, size) for seed, size in specs]


def _prompt(text: str, specs: list[tuple[int, tuple[int, int]]]) -> Any:
    return {"prompt": text, "multi_modal_data": {"image": _images(specs)}} if specs else text


def _generate(engine: LLMEngine, prompts: list[Any]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    final = run_checked(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]


def test_batch_of_image_and_text_prompts_matches_transformers(qwen_dir: pathlib.Path, reference: Any) -> None:
    """One image, two of different sizes, text only and an image first, in one batch; the
    engine's expanded prompt is transformers'."""
    expected = [reference(text, specs) for text, specs in CASES]
    engine = make_engine(qwen_dir)
    requests = [engine.make_request(f"p{i}", _prompt(t, s), GREEDY) for i, (t, s) in enumerate(CASES)]
    assert [r.prompt_token_ids for r in requests] == [prompt for prompt, _ in expected]
    assert [m.length for m in requests[1].mm_inputs] == [30, 24]
    assert _generate(engine, [_prompt(t, s) for t, s in CASES]) == [tokens for _, tokens in expected]
    assert engine.runner.images is not None and engine.runner.images.num_images_embedded == 4


def test_token_id_prompts_with_one_placeholder_or_expanded(qwen_dir: pathlib.Path, reference: Any) -> None:
    text, specs = CASES[1]
    prompt, tokens = reference(text, specs)
    collapsed = [t for i, t in enumerate(prompt) if t != IMAGE_PAD_ID or prompt[i - 1] != IMAGE_PAD_ID]
    data = {"image": _images(specs)}
    outputs = _generate(
        make_engine(qwen_dir),
        [
            {"prompt_token_ids": prompt, "multi_modal_data": data},
            {"prompt_token_ids": collapsed, "multi_modal_data": data},
        ],
    )
    assert outputs == [tokens, tokens]


@pytest.mark.parametrize("chunk", [7, 16])
def test_prefill_chunks_that_split_an_image_span(qwen_dir: pathlib.Path, reference: Any, chunk: int) -> None:
    """Chunks of 7 and 16 tokens cut every image span (M-RoPE positions mid-image); each image is
    embedded once."""
    cases = CASES[:2]
    expected = [reference(t, specs)[1] for t, specs in cases]
    engine = make_engine(qwen_dir, max_num_batched_tokens=chunk, block_size=8, max_num_seqs=2)
    assert _generate(engine, [_prompt(t, s) for t, s in cases]) == expected
    assert engine.runner.images is not None and engine.runner.images.num_images_embedded == 3


def test_preemption_keeps_outputs_equal(qwen_dir: pathlib.Path, reference: Any) -> None:
    """A KV cache too small for all four at once: sequences are preempted and recomputed (their
    images embedded again, their positions rebuilt) and still decode transformers' tokens."""
    expected = [reference(t, specs)[1] for t, specs in CASES]
    engine = make_engine(qwen_dir, num_kv_blocks=16, block_size=8, enable_prefix_caching=False)
    assert _generate(engine, [_prompt(t, s) for t, s in CASES]) == expected
    assert engine.stats().num_preemptions_total > 0


def test_hub_v4_layout_loads_alike(qwen_dir: pathlib.Path, reference: Any, tmp_path: pathlib.Path) -> None:
    """`model.*` (the text model), `visual.*` and `lm_head.*`: the hub's Qwen-VL files."""
    old = tmp_path / "old"
    old.mkdir()
    for f in qwen_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (old / f.name).write_bytes(f.read_bytes())
    renames = (("model.language_model.", "model."), ("model.visual.", "visual."), ("lm_head.", "lm_head."))
    renamed = {}
    for name, tensor in load_file(str(qwen_dir / "model.safetensors")).items():
        prefix, replacement = next((p, r) for p, r in renames if name.startswith(p))
        renamed[replacement + name.removeprefix(prefix)] = tensor
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    text, specs = CASES[1]
    assert _generate(make_engine(old), [_prompt(text, specs)]) == [reference(text, specs)[1]]


def test_prefix_cache_keys_blocks_by_image_content(qwen_dir: pathlib.Path, reference: Any) -> None:
    """Same text and image: a hit past the image. Another image of the same size: only the text
    before it hits, and the output is the new image's."""
    text = _turn(f"One, two, three, four, five, six, seven, eight, nine, ten. {IMAGE} What is this?")
    engine = make_engine(qwen_dir, block_size=4)
    first = _prompt(text, [(1, (40, 50))])
    probe = engine.make_request("probe", first, GREEDY)
    num_tokens, offset = len(probe.prompt_token_ids), probe.mm_inputs[0].offset
    assert cached_and_generated(engine, first, GREEDY)[0] == 0
    cached, tokens = cached_and_generated(engine, _prompt(text, [(1, (40, 50))]), GREEDY)
    assert cached == (num_tokens - 1) // 4 * 4
    assert tokens == reference(text, [(1, (40, 50))])[1]
    cached, tokens = cached_and_generated(engine, _prompt(text, [(2, (40, 50))]), GREEDY)
    assert cached == offset // 4 * 4
    assert tokens == reference(text, [(2, (40, 50))])[1]


async def test_engine_core_process_takes_images(qwen_dir: pathlib.Path, reference: Any) -> None:
    """CORRAL_ENGINE_PROCESS: the server's side builds the images (patches and grids) and pipes
    them to the core; the tokens are transformers'."""
    from corral_engine import EngineArgs, EngineCoreClient

    engine = EngineCoreClient(EngineArgs(model=str(qwen_dir), dtype="float32", num_kv_blocks=128))
    await engine.start()
    try:
        for i, (text, specs) in enumerate(CASES[:2]):
            prompt, expected = reference(text, specs)
            outputs = [out async for out in engine.add_request(f"c{i}", _prompt(text, specs), GREEDY)]
            assert outputs[-1].outputs[0].token_ids == expected
            assert outputs[-1].prompt_token_ids == prompt
    finally:
        await engine.shutdown()


def test_mrope_positions_are_transformers(qwen_dir: pathlib.Path) -> None:
    """Every token's (t, h, w) position, any chunk of it, and the decode delta, as
    transformers' get_rope_index computes them for two images of different sizes."""
    import transformers
    from corral_engine.model.mrope import mrope_positions, position_delta
    from transformers import AutoConfig

    arch = AutoConfig.from_pretrained(qwen_dir).architectures[0]
    model = getattr(transformers, arch).from_pretrained(qwen_dir, dtype=torch.float32)
    engine = make_engine(qwen_dir)
    request = engine.make_request("p", _prompt(*CASES[1]), GREEDY)
    ids = torch.tensor([request.prompt_token_ids])
    grids = torch.tensor([m.grid_thw for m in request.mm_inputs])
    expected, delta = model.model.get_rope_index(ids, (ids == IMAGE_PAD_ID).int(), image_grid_thw=grids)
    n = len(request.prompt_token_ids)
    assert mrope_positions(request.mm_inputs, 2, 0, n).tolist() == expected[:, 0].tolist()
    assert mrope_positions(request.mm_inputs, 2, 9, 40).tolist() == expected[:, 0, 9:40].tolist()
    assert position_delta(request.mm_inputs, 2) == int(delta)
    past = mrope_positions(request.mm_inputs, 2, n, n + 3)
    assert past.tolist() == [[n + int(delta) + i for i in range(3)]] * 3


def test_windows_and_patch_positions_are_transformers(qwen_dir: pathlib.Path) -> None:
    from corral_engine.model.config import load_model_config
    from corral_engine.model.qwen_vision import patch_positions, window_order
    from corral_engine.qwen_vision_config import QwenVisionConfig
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    vision = load_model_config(qwen_dir).vision
    assert isinstance(vision, QwenVisionConfig)
    grids = [(1, 10, 12), (1, 16, 6), (1, 6, 18)]
    assert patch_positions(grids, 2).tolist() == get_vision_position_ids(torch.tensor(grids), 2).tolist()
    order, spans = window_order(grids, vision if vision.window_size else _windowed(vision))
    index, cu = get_vision_window_index(torch.tensor(grids), 2, 16, 4)
    assert order.tolist() == index.tolist()
    assert [0, *(end for _, end in spans)] == cu.tolist()


def _windowed(vision: Any) -> Any:
    import dataclasses

    return dataclasses.replace(vision, window_size=16)


def test_video_and_mismatched_images_are_refused(qwen_dir: pathlib.Path) -> None:
    engine = make_engine(qwen_dir)
    with pytest.raises(InvalidRequestError, match="only 'image'"):
        engine.make_request("v", {"prompt": "x", "multi_modal_data": {"video": [_image(1)]}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="1 image placeholder tokens for 2 image"):
        engine.make_request("a", _prompt(CASES[0][0], [(1, (40, 50)), (2, (40, 50))]), GREEDY)
    text, specs = CASES[0]
    prompt = engine.make_request("p", _prompt(text, specs), GREEDY).prompt_token_ids
    with pytest.raises(InvalidRequestError, match="placeholder"):  # 30 placeholders for a 24-token image
        engine.make_request(
            "b", {"prompt_token_ids": prompt, "multi_modal_data": {"image": _image(1, (64, 24))}}, GREEDY
        )


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"enable_lora": True}, "--enable-lora"),
        ({"speculative": "ngram"}, "--speculative"),
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size > 1"),
    ],
)
def test_refuses_options_at_start(qwen_dir: pathlib.Path, option: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=f"{named}.*vision-language"):
        make_engine(qwen_dir, **option)


def test_decode_graphs_run_at_the_position_delta(qwen_dir: pathlib.Path, reference: Any) -> None:
    """The triton backend (Triton's interpreter) with decode graphs (EagerCapture replays them
    over their persistent buffers): decodes past an image replay the plain 1-D graph with each
    sequence's positions shifted by its delta, and still decode transformers' tokens."""
    from corral_engine.model.cuda_graphs import EagerCapture
    from corral_engine.settings import EngineSettings

    capture = EagerCapture()
    engine = make_engine(
        qwen_dir,
        EngineSettings(triton_interpret=True),
        graph_capture=capture,
        attention_backend="triton",
        max_num_seqs=2,
    )
    cases = CASES[:2]
    assert _generate(engine, [_prompt(t, s) for t, s in cases]) == [reference(t, s)[1] for t, s in cases]
    assert capture.replayed
