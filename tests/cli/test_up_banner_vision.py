"""`corral up`'s banner for a vision-language model: its curl example, pasted as it is printed,
is a chat request with an image that the engine serving the demo LLaVA answers."""

from __future__ import annotations

import json
import pathlib
import shlex

import pytest
from corral_cli import up_banner
from corral_engine.demo_llava import write_llava_model

from tests.server.real_engine import http_client


def _curl_body(banner: str) -> dict[str, object]:
    """The JSON after `-d` in the banner's curl command, read as a shell would."""
    start = banner.index("  curl ")
    command = banner[start : banner.index("\n\n", start)].replace("\\\n", " ")
    words = shlex.split(command)
    return json.loads(words[words.index("-d") + 1])


@pytest.mark.asyncio
async def test_the_vision_banners_curl_example_is_answered(tmp_path: pathlib.Path) -> None:
    model = write_llava_model(tmp_path / "llava")
    assert up_banner.fleet_kind(["--model", str(model)]) == "vision"
    body = _curl_body(up_banner.usage_text("http://127.0.0.1:9000", "llava", "vision"))
    async with http_client(model, served_model_name="llava", max_model_len=256, num_kv_blocks=64) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["prompt_tokens"] > 16  # the demo's 16 image tokens and the text's
