"""Chat completions with an image_url part on the demo Qwen2.5-VL, served by the real engine: the
official openai client's greedy reply to a data: URL image equals the offline engine's for the
checkpoint's chat template and the same image (the offline engine equals transformers:
tests/engine/test_qwen_vl.py); a video part is a 400."""

from __future__ import annotations

import base64
import io
import pathlib
from typing import Any

import numpy as np
import pytest
from corral_engine.demo_qwen_vl import write_qwen_vl_model
from corral_engine.sampling_params import SamplingParams
from PIL import Image

from tests.engine.helpers import make_engine
from tests.server.real_engine import http_client, openai_client

MAX_NEW = 8


def _png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_qwen_vl_model(tmp_path_factory.mktemp("qwen2_5_vl") / "m", "qwen2_5_vl")


def _messages(url: str) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": content}]


async def test_data_url_image_replies_as_the_offline_engine(qwen_dir: pathlib.Path) -> None:
    image = _png(1, (40, 50))  # 30 image tokens
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    offline = make_engine(qwen_dir)
    template_messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]}
    ]
    text = offline.tokenizer.apply_chat_template(
        template_messages, tokenize=False, add_generation_prompt=True
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": Image.open(io.BytesIO(image))}}
    (expected,) = offline.generate([prompt], params)
    async with openai_client(qwen_dir) as client:
        reply = await client.chat.completions.create(
            model="m",
            messages=_messages(url),
            max_tokens=MAX_NEW,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids) + 29  # one placeholder became 30


async def test_video_parts_are_refused(qwen_dir: pathlib.Path) -> None:
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    async with http_client(qwen_dir) as http:
        resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "'video_url'" in error["message"]
