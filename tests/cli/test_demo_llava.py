"""`corral demo-model DIR --arch llava`: a tiny LLaVA that transformers loads offline (model and
processor, whose expansion of `<image>` the engine's matches), and the options it refuses."""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import pytest
from corral_cli import main
from PIL import Image


def test_writes_a_llava_transformers_loads_offline(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "llava"
    assert main.main(["demo-model", str(out), "--arch", "llava", "--quiet"]) == 0
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(out, local_files_only=True)
    processor = AutoProcessor.from_pretrained(out, local_files_only=True)
    image = Image.fromarray(np.zeros((20, 30, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[image], return_tensors="np")
    image_token = model.config.image_token_id
    assert (inputs["input_ids"] == image_token).sum() == 16  # (32 / 8) ** 2 patches, CLS dropped
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    assert (out / "preprocessor_config.json").is_file()


def test_refuses_other_presets(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        code = main.main(["demo-model", str(tmp_path / "x"), "--arch", "llava", "--preset", "small"])
    assert code == 2
    assert "--preset small" in caplog.text and not (tmp_path / "x").exists()
