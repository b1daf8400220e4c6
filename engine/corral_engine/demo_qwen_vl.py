"""Tiny random-weight Qwen2-VL and Qwen2.5-VL checkpoints (`corral demo-model DIR --arch qwen2_vl`
or `qwen2_5_vl`): the tiny Qwen2 text model with M-RoPE, a vision tower on 4x4 patches merged 2x2
(a 40x50 image is 30 image tokens), the demo tokenizer with Qwen's vision tokens and a ChatML
template placing images, and the processor files transformers' AutoProcessor loads (the PIL
Qwen2-VL image processor: no torchvision)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from corral_engine.demo_tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    QWEN_VL_TOKENS,
    tokenizer_config,
    train_tokenizer,
)

QWEN_VL_ARCHS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
# <|im_start|> <|im_end|> <|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|>: ids 3 to 8.
IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(3, 9)
PATCH_SIZE, MERGE_SIZE = 4, 2
# Images are resized to multiples of 8 pixels, between 8x8 and 64x64 pixels' worth.
MIN_PIXELS, MAX_PIXELS = 64, 64 * 64
MROPE_SECTION = [2, 3, 3]  # of the tiny text model's 8 frequency pairs (head_dim 16), as 16/24/24 of 64
_VISION: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"depth": 3, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 4, "hidden_act": "quick_gelu"},
    # Windows of 16 pixels (2x2 merge blocks); layers 1 and 3 attend over the whole image.
    "qwen2_5_vl": {
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 4,
        "hidden_act": "silu",
        "window_size": 16,
        "fullatt_block_indexes": [1, 3],
    },
}


def qwen_vl_config(arch: str, text: dict[str, Any]) -> Any:
    """transformers' Qwen2VLConfig or Qwen2_5_VLConfig around the demo text config `text`."""
    import transformers

    name = "Qwen2VLConfig" if arch == "qwen2_vl" else "Qwen2_5_VLConfig"
    kwargs = {k: v for k, v in text.items() if k not in ("architectures", "dtype", "rope_theta")}
    kwargs["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": text["rope_theta"],
        "mrope_section": MROPE_SECTION,
    }
    hidden = text["hidden_size"]
    vision = dict(_VISION[arch], patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
    vision["hidden_size" if arch == "qwen2_vl" else "out_hidden_size"] = hidden
    config = getattr(transformers, name)(
        text_config=kwargs,
        vision_config=vision,
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=arch == "qwen2_vl",  # as Qwen2-VL-2B's; Qwen2.5-VL-7B's is untied
    )
    config.architectures = [QWEN_VL_ARCHS[arch]]
    return config


def write_processor(out: pathlib.Path, arch: str) -> None:
    """processor_config.json (with the image processor, v5's layout), preprocessor_config.json and
    chat_template.jinja. Written as transformers writes them, not through its Qwen2VLProcessor,
    whose constructor needs the video processor (torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from corral_engine.demo_model import _write_json
    from corral_engine.demo_tokenizer import QWEN_VL_CHAT_TEMPLATE

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE, merge_size=MERGE_SIZE
    )
    image_processor.save_pretrained(str(out))  # preprocessor_config.json
    settings = image_processor.to_dict()
    settings["image_processor_type"] = "Qwen2VLImageProcessor"
    processor_class = "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor"
    _write_json(
        out / "processor_config.json", {"image_processor": settings, "processor_class": processor_class}
    )
    (out / "chat_template.jinja").write_text(QWEN_VL_CHAT_TEMPLATE)


def write_qwen_vl_model(
    out_dir: str | os.PathLike[str], arch: str = "qwen2_5_vl", seed: int = 0
) -> pathlib.Path:
    """Write the tiny `arch` checkpoint (qwen2_vl or qwen2_5_vl) to `out_dir`, weights under
    transformers v5's names (`model.language_model.*`, `model.visual.*`, `lm_head.*`)."""
    import transformers

    from corral_engine.demo_llava import write_drawn_model
    from corral_engine.demo_model import _write_json, build_config_dict, preset_config

    if arch not in QWEN_VL_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; Qwen-VL demos: {', '.join(QWEN_VL_ARCHS)}")
    p = preset_config("tiny")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(seed, p.vocab_size, p.num_corpus_words, p.lexicon_size, "qwen_vl")
    if [tok.token_to_id(t) for t in QWEN_VL_TOKENS] != list(range(IM_START_ID, VIDEO_PAD_ID + 1)):
        raise RuntimeError(f"the Qwen-VL demo tokens did not get ids {IM_START_ID}..{VIDEO_PAD_ID}")
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", tokenizer_config(p.max_position_embeddings, "qwen_vl"))
    config = qwen_vl_config(arch, build_config_dict("tiny", "qwen2"))
    write_drawn_model(out, getattr(transformers, QWEN_VL_ARCHS[arch]), config, seed)
    ids = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, IM_END_ID],
        "pad_token_id": PAD_TOKEN_ID,
    }
    _write_json(out / "generation_config.json", ids)
    write_processor(out, arch)
    # The processor rewrote tokenizer_config.json in its own terms: the demo's, as the other demos write it.
    processor_class = "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor"
    tokenizer_json = tokenizer_config(p.max_position_embeddings, "qwen_vl") | {
        "processor_class": processor_class
    }
    _write_json(out / "tokenizer_config.json", tokenizer_json)
    return out
