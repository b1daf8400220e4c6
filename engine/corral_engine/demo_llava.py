"""A tiny random-weight LLaVA-1.5 checkpoint (`corral demo-model DIR --arch llava`): a CLIP vision
tower on 32x32 images in 8x8 patches (16 image tokens), the tiny Llama text model, the demo
tokenizer with an `<image>` special token and a chat template placing images, and the processor
files transformers' AutoProcessor loads (a PIL CLIP image processor: no torchvision)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from corral_engine.demo_tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN,
    PAD_TOKEN_ID,
    tokenizer_config,
    train_tokenizer,
)

IMAGE_TOKEN_ID = 3  # the llava tokenizer style's first special after pad, bos, eos
IMAGE_SIZE, PATCH_SIZE = 32, 8
# Three vision layers: the default feature layer (-2) then skips the last one, as LLaVA-1.5 does.
VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "projection_dim": 32,
    "hidden_act": "quick_gelu",
}


def llava_config(text: dict[str, Any]) -> Any:
    """transformers' LlavaConfig around the demo text config `text` (build_config_dict's)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    kwargs = {k: v for k, v in text.items() if k not in ("architectures", "dtype")}
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=LlamaConfig(**kwargs),
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


def write_processor(out: pathlib.Path) -> None:
    """processor_config.json (with the image processor, v5's layout), preprocessor_config.json and
    chat_template.jinja, as transformers writes them."""
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(str(out))
    image_processor.save_pretrained(str(out))  # preprocessor_config.json, for loaders before v5


def write_drawn_model(out: pathlib.Path, model_class: Any, config: Any, seed: int) -> None:
    """A vision-language demo's weights (drawn as the text demos', the tiny preset's std) in one
    safetensors file, and its config.json as transformers writes it (float32)."""
    import torch
    from safetensors.torch import save_file

    from corral_engine.demo_model import _draw, _write_json, preset_config, shard_file_names

    p = preset_config("tiny")
    with torch.device("meta"):
        model = model_class(config)
    gen = torch.Generator().manual_seed(seed)
    state = {
        name: _draw(name, tuple(t.shape), gen, p.initializer_range, p, "cpu").contiguous()
        for name, t in sorted(model.named_parameters(), key=lambda kv: kv[0])
    }
    (file,) = shard_file_names(1)
    save_file(state, str(out / file), metadata={"format": "pt"})
    config_json = config.to_diff_dict()
    config_json.pop("transformers_version", None)
    config_json["dtype"] = "float32"
    _write_json(out / "config.json", config_json)


def write_llava_model(out_dir: str | os.PathLike[str], seed: int = 0) -> pathlib.Path:
    """Write the tiny LLaVA checkpoint to `out_dir` (weights under transformers v5's names)."""
    from transformers import LlavaForConditionalGeneration

    from corral_engine.demo_model import _write_json, build_config_dict, preset_config

    p = preset_config("tiny")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(seed, p.vocab_size, p.num_corpus_words, p.lexicon_size, "llava")
    if tok.token_to_id(IMAGE_TOKEN) != IMAGE_TOKEN_ID:
        raise RuntimeError(f"{IMAGE_TOKEN} got id {tok.token_to_id(IMAGE_TOKEN)}, not {IMAGE_TOKEN_ID}")
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(p.max_position_embeddings, "llava")
    )  # the processor reads it
    config = llava_config(build_config_dict("tiny", "llama"))
    write_drawn_model(out, LlavaForConditionalGeneration, config, seed)
    ids = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}
    _write_json(out / "generation_config.json", ids)
    write_processor(out)
    # The processor rewrote tokenizer_config.json in its own terms: the demo's, as the other demos write it.
    tokenizer_json = tokenizer_config(p.max_position_embeddings, "llava") | {
        "processor_class": "LlavaProcessor"
    }
    _write_json(out / "tokenizer_config.json", tokenizer_json)
    return out
