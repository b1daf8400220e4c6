"""LLaVA in the engine: greedy float32 tokens equal transformers' LlavaForConditionalGeneration for
one image, two images, a batch mixing text-only and image prompts, prefill chunks that split an
image's span, both checkpoint layouts; prefix caching keyed by image content; preemption; the
refusals."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch
from corral_engine.demo_llava import IMAGE_TOKEN_ID, write_llava_model
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.engine.helpers import cached_and_generated, make_engine, run_checked

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
NUM_IMAGE_TOKENS = 16  # the demo's 32x32 images in 8x8 patches, CLS dropped


def _image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_llava_model(tmp_path_factory.mktemp("llava") / "m")


@pytest.fixture(scope="module")
def reference(llava_dir: pathlib.Path) -> Any:
    """transformers' greedy tokens for (text, images), with its own processor, in float32."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava_dir, local_files_only=True)
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()

    def greedy(text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        return prompt, out[0, len(prompt) :].tolist()

    return greedy


CASES: list[tuple[str, list[int]]] = [
    ("Hello, world! <image> What is in the picture?", [1]),
    ("Compare <image> and <image> please.", [2, 3]),
    ("The quick brown fox jumps over the lazy dog.", []),
    ("<image>\nOnce upon a time there was a small cat.", [4]),
]


def _prompt(text: str, seeds: list[int]) -> Any:
    if not seeds:
        return text
    return {"prompt": text, "multi_modal_data": {"image": [_image(s) for s in seeds]}}


def _generate(engine: LLMEngine, prompts: list[Any]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    final = run_checked(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]


def test_batch_of_image_and_text_prompts_matches_transformers(
    llava_dir: pathlib.Path, reference: Any
) -> None:
    """One image, two images, a text-only prompt and an image first, in one batch; the engine's
    expanded prompt is the processor's."""
    expected = [reference(text, [_image(s) for s in seeds]) for text, seeds in CASES]
    engine = make_engine(llava_dir)
    requests = [engine.make_request(f"p{i}", _prompt(t, s), GREEDY) for i, (t, s) in enumerate(CASES)]
    assert [r.prompt_token_ids for r in requests] == [prompt for prompt, _ in expected]
    assert _generate(engine, [_prompt(t, s) for t, s in CASES]) == [tokens for _, tokens in expected]
    assert engine.runner.images is not None and engine.runner.images.num_images_embedded == 4


def test_token_id_prompts_with_one_placeholder_or_expanded(llava_dir: pathlib.Path, reference: Any) -> None:
    text, seeds = CASES[0]
    prompt, tokens = reference(text, [_image(s) for s in seeds])
    start = prompt.index(IMAGE_TOKEN_ID)
    collapsed = prompt[: start + 1] + prompt[start + NUM_IMAGE_TOKENS :]
    image = {"image": _image(seeds[0])}
    engine = make_engine(llava_dir)
    outputs = _generate(
        engine,
        [
            {"prompt_token_ids": prompt, "multi_modal_data": image},
            {"prompt_token_ids": collapsed, "multi_modal_data": image},
        ],
    )
    assert outputs == [tokens, tokens]


@pytest.mark.parametrize("chunk", [5, 8, 13])
def test_prefill_chunks_that_split_an_image_span(llava_dir: pathlib.Path, reference: Any, chunk: int) -> None:
    """Chunks of 5, 8 and 13 tokens cut each 16-token image span; the image is embedded once."""
    cases = CASES[:2]
    expected = [reference(t, [_image(s) for s in seeds])[1] for t, seeds in cases]
    engine = make_engine(llava_dir, max_num_batched_tokens=chunk, block_size=8, max_num_seqs=2)
    assert _generate(engine, [_prompt(t, s) for t, s in cases]) == expected
    assert engine.runner.images is not None and engine.runner.images.num_images_embedded == 3


def test_old_hub_layout_loads_alike(llava_dir: pathlib.Path, reference: Any, tmp_path: pathlib.Path) -> None:
    """`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.vision_model.*`: the
    hub's layout before transformers v4.52 (and what save_pretrained writes)."""
    old = tmp_path / "old"
    old.mkdir()
    for f in llava_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (old / f.name).write_bytes(f.read_bytes())
    renames = (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    state = load_file(str(llava_dir / "model.safetensors"))
    renamed = {}
    for name, tensor in state.items():
        prefix, replacement = next((p, r) for p, r in renames if name.startswith(p))
        renamed[replacement + name.removeprefix(prefix)] = tensor
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    text, seeds = CASES[1]
    expected = reference(text, [_image(s) for s in seeds])[1]
    assert _generate(make_engine(old), [_prompt(text, seeds)]) == [expected]


def test_prefix_cache_keys_blocks_by_image_content(llava_dir: pathlib.Path, reference: Any) -> None:
    """Same text and image: a hit past the image. Same text, another image: the blocks holding
    placeholders miss (only the text before the image hits), and the output is the new image's."""
    text = "One, two, three, four, five, six, seven, eight, nine, ten. <image> What is this?"
    engine = make_engine(llava_dir, block_size=4)
    first = _prompt(text, [1])
    num_tokens = len(engine.make_request("probe", first, GREEDY).prompt_token_ids)
    offset = engine.make_request("probe", first, GREEDY).mm_inputs[0].offset
    assert cached_and_generated(engine, first, GREEDY)[0] == 0
    cached, tokens = cached_and_generated(engine, _prompt(text, [1]), GREEDY)
    assert cached == (num_tokens - 1) // 4 * 4  # everything cacheable hit
    assert tokens == reference(text, [_image(1)])[1]
    cached, tokens = cached_and_generated(engine, _prompt(text, [2]), GREEDY)
    assert cached == offset // 4 * 4  # the text before the image only
    assert tokens == reference(text, [_image(2)])[1]


def test_preemption_keeps_outputs_equal(llava_dir: pathlib.Path, reference: Any) -> None:
    """A KV cache too small for all four at once: sequences are preempted and recomputed (their
    images embedded again) and still decode transformers' tokens."""
    expected = [reference(t, [_image(s) for s in seeds])[1] for t, seeds in CASES]
    engine = make_engine(llava_dir, num_kv_blocks=12, block_size=8, enable_prefix_caching=False)
    assert _generate(engine, [_prompt(t, s) for t, s in CASES]) == expected
    assert engine.stats().num_preemptions_total > 0


def test_image_refusals(llava_dir: pathlib.Path, tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(llava_dir)
    two_images = {"image": [_image(1), _image(2)]}
    with pytest.raises(InvalidRequestError, match="1 image placeholder tokens for 2 image"):
        engine.make_request("a", {"prompt": "one <image> only", "multi_modal_data": two_images}, GREEDY)
    with pytest.raises(InvalidRequestError, match="2 image placeholder tokens for 1 image"):
        engine.make_request(
            "b", {"prompt": "<image> <image>", "multi_modal_data": {"image": _image(1)}}, GREEDY
        )
    with pytest.raises(InvalidRequestError, match="1 image placeholder tokens for 0 image"):
        engine.make_request("c", "a placeholder <image> without its image", GREEDY)
    with pytest.raises(InvalidRequestError, match="only 'image'"):
        engine.make_request("d", {"prompt": "x", "multi_modal_data": {"video": [1]}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="PIL images"):
        engine.make_request("e", {"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, GREEDY)
    text_engine = make_engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="not a vision-language model") as info:
        text_engine.make_request("f", {"prompt": "x", "multi_modal_data": {"image": _image(1)}}, GREEDY)
    assert info.value.param == "multi_modal_data"


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"enable_lora": True}, "--enable-lora"),
        ({"speculative": "ngram"}, "--speculative"),
        ({"runner": "pooling"}, "--runner pooling"),
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size > 1"),
    ],
)
def test_vision_model_refuses_options_at_start(
    llava_dir: pathlib.Path, option: dict[str, Any], named: str
) -> None:
    with pytest.raises(ModelLoadError, match=f"{named}.*vision-language"):
        make_engine(llava_dir, **option)


def test_llava_next_is_refused_by_name(llava_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    import json

    from corral_engine.model.config import load_model_config

    config = json.loads((llava_dir / "config.json").read_text())
    config["architectures"] = ["LlavaNextForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"LlavaNextForConditionalGeneration.*anyres"):
        load_model_config(tmp_path)


async def test_engine_core_process_takes_images(llava_dir: pathlib.Path, reference: Any) -> None:
    """CORRAL_ENGINE_PROCESS: the server's side processes the images and pipes their pixels to the
    core; the tokens are transformers'; a bad image request is refused at once, on this side."""
    from corral_engine import EngineArgs, EngineCoreClient

    engine = EngineCoreClient(EngineArgs(model=str(llava_dir), dtype="float32", num_kv_blocks=128))
    await engine.start()
    try:
        for i, (text, seeds) in enumerate(CASES[:3]):
            prompt, expected = reference(text, [_image(s) for s in seeds])
            outputs = [out async for out in engine.add_request(f"c{i}", _prompt(text, seeds), GREEDY)]
            assert outputs[-1].outputs[0].token_ids == expected
            assert outputs[-1].prompt_token_ids == prompt
        with pytest.raises(InvalidRequestError, match="placeholder"):
            engine.add_request(
                "bad", {"prompt": "no placeholder", "multi_modal_data": {"image": _image(1)}}, GREEDY
            )
    finally:
        await engine.shutdown()


def test_max_images_per_prompt(llava_dir: pathlib.Path) -> None:
    """--max-images-per-prompt (vLLM's --limit-mm-per-prompt image=N): more images are refused,
    offline and as the engine core's own process gets them (already processed); 0 refuses any."""
    engine = make_engine(llava_dir, max_images_per_prompt=1)
    engine.make_request("one", _prompt(*CASES[0]), GREEDY)
    with pytest.raises(InvalidRequestError, match="at most 1 a prompt"):
        engine.make_request("two", _prompt(*CASES[1]), GREEDY)
    unlimited = make_engine(llava_dir).request_builder.images
    assert unlimited is not None
    ids = engine.tokenizer.encode("Compare <image> and <image>.")
    token_ids, built = unlimited.build(ids, [_image(1), _image(2)])
    with pytest.raises(InvalidRequestError, match="at most 1 a prompt"):
        engine.make_request("built", token_ids, GREEDY, mm_inputs=built)
    none = make_engine(llava_dir, max_images_per_prompt=0)
    with pytest.raises(InvalidRequestError, match="at most 0 a prompt"):
        none.make_request("one", _prompt(*CASES[0]), GREEDY)
