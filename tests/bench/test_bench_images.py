"""`corral bench --random-images N`: each chat request carries images of its own (JPEG noise as
data: URLs, OpenAI's content parts), the same for the same seed, fresh per run; refused where no
image can go."""

from __future__ import annotations

import argparse
import base64
import io

import pytest
from corral_cli.bench.client import RequestSettings, build_body
from corral_cli.bench.images import parse_size, with_images
from corral_cli.bench.workload import BenchRequest
from corral_cli.cmd_bench import _load_workloads, add_arguments
from corral_cli.main import main as corral_main
from PIL import Image


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _decode(url: str) -> Image.Image:
    head, _, data = url.partition(",")
    assert head == "data:image/jpeg;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_a_chat_body_carries_the_text_then_each_image_as_content_parts():
    chat = RequestSettings("http://x", "m", endpoint_type="chat")
    plain = build_body(chat, BenchRequest("hello", 1, 4))
    assert plain["messages"] == [{"role": "user", "content": "hello"}]
    body = build_body(chat, BenchRequest("hello", 1, 4, image_urls=("data:a", "data:b")))
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image_url", "image_url": {"url": "data:a"}},
                {"type": "image_url", "image_url": {"url": "data:b"}},
            ],
        }
    ]


def test_every_request_gets_images_of_its_own_of_the_size_asked():
    requests = [BenchRequest(f"p{i}", 2, 4) for i in range(3)]
    first = with_images(requests, 2, (40, 30), seed=7)
    urls = [u for r in first for u in r.image_urls]
    assert [len(r.image_urls) for r in first] == [2, 2, 2] and len(set(urls)) == 6
    assert all(_decode(u).size == (40, 30) for u in urls)
    assert [r.prompt for r in first] == ["p0", "p1", "p2"]  # the text is untouched
    assert with_images(requests, 2, (40, 30), seed=7) == first  # the same seed, the same images
    other = {u for r in with_images(requests, 2, (40, 30), seed=7, variant=1) for u in r.image_urls}
    assert not other & set(urls)  # another run of a sweep: other images


def test_the_workloads_give_each_run_and_the_warmup_their_own_images():
    args = _args(
        "--endpoint-type", "chat", "--random-images", "1", "--random-image-size", "16x24",
        "--num-prompts", "3", "--random-input-len", "8", "--warmup-requests", "2",
    )  # fmt: skip
    runs, warmup, _ = _load_workloads(args, 2)
    urls = [r.image_urls for run in [*runs, warmup] for r in run]
    assert [len(u) for u in urls] == [1] * 8 and len({u[0] for u in urls}) == 8
    assert _decode(urls[0][0]).size == (16, 24)


@pytest.mark.parametrize("size", ["336", "0x10", "10x", "9000x10", "axb"])
def test_a_bad_size_is_refused_naming_the_flag(size: str):
    with pytest.raises(ValueError, match="--random-image-size"):
        parse_size(size)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--random-images", "1"], "--endpoint-type chat"),  # completions: token ids, no images
        (["--endpoint-type", "chat", "--random-images", "1", "--random-image-size", "big"], "WIDTHxHEIGHT"),
    ],
)
def test_refused_before_anything_is_sent(argv: list[str], message: str, caplog: pytest.LogCaptureFixture):
    # Port 9 (discard) on loopback: nothing listens, and nothing may be sent anyway.
    assert corral_main(["bench", "--base-url", "http://127.0.0.1:9", "--no-progress", *argv]) == 1
    assert message in caplog.text
