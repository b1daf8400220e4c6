"""`corral demo-model DIR --arch qwen2_vl|qwen2_5_vl`: tiny Qwen-VL checkpoints that transformers
loads offline (model, tokenizer, chat template and PIL image processor), and the options refused."""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import pytest
from corral_cli import main
from PIL import Image


@pytest.mark.parametrize(
    ("arch", "model_class"),
    [("qwen2_vl", "Qwen2VLForConditionalGeneration"), ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")],
)
def test_writes_a_qwen_vl_transformers_loads_offline(
    tmp_path: pathlib.Path, arch: str, model_class: str
) -> None:
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    out = tmp_path / arch
    assert main.main(["demo-model", str(out), "--arch", arch, "--quiet"]) == 0
    model = getattr(transformers, model_class).from_pretrained(out, local_files_only=True)
    assert model.config.architectures == [model_class]
    processor = AutoImageProcessor.from_pretrained(out, local_files_only=True, backend="pil")
    inputs = processor(images=[Image.fromarray(np.zeros((40, 50, 3), dtype=np.uint8))], return_tensors="np")
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 12]]  # 40x48 pixels in 4x4 patches
    assert inputs["pixel_values"].shape == (120, 3 * 2 * 4 * 4)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>what?<|im_end|>" in text
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


def test_refuses_other_presets(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        code = main.main(["demo-model", str(tmp_path / "x"), "--arch", "qwen2_5_vl", "--preset", "small"])
    assert code == 2
    assert "--preset small" in caplog.text and not (tmp_path / "x").exists()
