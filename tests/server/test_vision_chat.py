"""Chat completions with image_url parts on the demo LLaVA, served by the real engine (in the
server's process and in the engine core's own): the official openai client's greedy replies equal
the offline engine's for the same prompt and images, streamed or not; data: and loopback http
URLs; each refusal a 400 naming the part."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from corral_engine.demo_llava import IMAGE_TOKEN_ID, write_llava_model
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import image_urls
from corral_engine.settings import EngineSettings
from PIL import Image

from tests.engine.helpers import make_engine
from tests.server.real_engine import assert_invalid_request, http_client, openai_client

MAX_NEW = 8
NUM_IMAGE_TOKENS = 16  # the demo's 32x32 images in 8x8 patches


def _png(seed: int, size: tuple[int, int] = (40, 50), kind: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=kind)
    return out.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_llava_model(tmp_path_factory.mktemp("llava") / "m")


@pytest.fixture(scope="module")
def offline(llava_dir: pathlib.Path) -> LLMEngine:
    return make_engine(llava_dir)


def _offline_reply(engine: LLMEngine, messages: list[dict[str, Any]], images: list[bytes]) -> tuple[str, int]:
    """(greedy text, prompt tokens) of the offline engine for the template's rendering of
    `messages` (image parts as transformers' `{"type": "image"}`) and the images' PIL decodings."""
    for message in messages:
        if isinstance(message["content"], list):
            message["content"] = [
                {"type": "image"} if p["type"] == "image_url" else p for p in message["content"]
            ]
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    pil = [Image.open(io.BytesIO(data)) for data in images]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    (out,) = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": pil}}], params)
    return out.outputs[0].text, len(out.prompt_token_ids)


def _messages(urls: list[str]) -> list[dict[str, Any]]:
    """Two user turns: a text and an image, then an image, text and another image."""
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, _image_part(urls[0])]},
        {"role": "assistant", "content": "A picture."},
        {
            "role": "user",
            "content": [_image_part(urls[1]), {"type": "text", "text": "Compare with"}, _image_part(urls[2])],
        },
    ]


@pytest.mark.parametrize("engine_process", ["0", "1"])
async def test_image_parts_reply_as_the_offline_engine(
    llava_dir: pathlib.Path, offline: LLMEngine, engine_process: str
) -> None:
    """Three images (PNG, JPEG) in two user turns: the same greedy text and token counts as the
    offline engine, the prompt counting each image's 16 placeholder tokens; streamed alike."""
    images = [_png(1), _png(2, (64, 30), "JPEG"), _png(3)]
    urls = [_data_url(images[0]), _data_url(images[1], "image/jpeg"), _data_url(images[2])]
    expected, num_prompt = _offline_reply(offline, _messages(urls), images)
    settings = EngineSettings(engine_process=engine_process)
    async with openai_client(llava_dir, settings=settings) as client:
        kwargs: Any = {
            "model": "m",
            "max_tokens": MAX_NEW,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        reply = await client.chat.completions.create(messages=_messages(urls), **kwargs)
        stream = await client.chat.completions.create(
            messages=_messages(urls), stream=True, stream_options={"include_usage": True}, **kwargs
        )
        chunks = [chunk async for chunk in stream]
    assert reply.choices[0].message.content == expected
    assert reply.usage is not None and reply.usage.prompt_tokens == num_prompt
    assert reply.usage.completion_tokens == MAX_NEW
    assert num_prompt > 3 * NUM_IMAGE_TOKENS
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == num_prompt


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, bytes, dict[str, str]]] = {}  # noqa: RUF012 (set per server)

    def do_GET(self) -> None:
        status, body, headers = self.routes.get(self.path, (404, b"no such image", {}))
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # quiet: pytest shows stderr of failures only
        pass


@contextlib.contextmanager
def _image_server(routes: dict[str, tuple[int, bytes, dict[str, str]]]) -> Iterator[str]:
    """A loopback HTTP server answering `routes` (path -> status, body, headers); its base URL."""
    handler = type("Handler", (_ImageHandler,), {"routes": routes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_http_image_urls_are_fetched(
    llava_dir: pathlib.Path, offline: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An http URL (one through a redirect) replies as its data: URL; a 404, a redirect loop, a
    body over the size cap and a page that is not an image are 400s naming their part."""
    images = [_png(4), _png(5), _png(6)]
    monkeypatch.setattr(image_urls, "MAX_IMAGE_BYTES", 16384)
    routes = {
        "/a.png": (200, images[0], {"Content-Type": "image/png"}),
        "/b": (302, b"", {"Location": "/b.png"}),
        "/b.png": (200, images[1], {}),
        "/loop": (302, b"", {"Location": "/loop"}),
        "/big.png": (200, _png(7, (100, 100)), {}),
        "/page.html": (200, b"<html>not an image</html>", {"Content-Type": "text/html"}),
    }
    with _image_server(routes) as base:
        urls = [f"{base}/a.png", f"{base}/b", _data_url(images[2])]
        expected, num_prompt = _offline_reply(offline, _messages(urls), images)
        async with http_client(llava_dir) as http:
            body = {"model": "m", "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
            resp = await http.post("/v1/chat/completions", json={**body, "messages": _messages(urls)})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == expected
            assert resp.json()["usage"]["prompt_tokens"] == num_prompt
            for path, text in [
                ("/missing.png", "answered 404"),
                ("/loop", "redirected more than"),
                ("/big.png", "larger than 16384 bytes"),
                ("/page.html", "not an image"),
            ]:
                bad = _messages([urls[0], f"{base}{path}", urls[2]])
                resp = await http.post("/v1/chat/completions", json={**body, "messages": bad})
                assert_invalid_request(resp, 400, "messages[3].content[0].image_url", text)


class _Counting(_ImageHandler):
    """Counts the GETs it answers (class-wide: one server a test)."""

    gets = 0

    def do_GET(self) -> None:
        type(self).gets += 1
        super().do_GET()


async def test_allowed_media_domains_bound_what_is_fetched(llava_dir: pathlib.Path) -> None:
    """--allowed-media-domains: a URL of another host is refused before any fetch, and so is a
    redirect to one (127.0.0.1 allowed, localhost not); data: URLs are always taken."""
    image = _png(8)
    routes = {"/a.png": (200, image, {}), "/away": (302, b"", {"Location": "/a.png"})}
    handler = type("Handler", (_Counting,), {"routes": routes, "gets": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    routes["/away"] = (302, b"", {"Location": f"http://localhost:{port}/a.png"})
    body = {"model": "m", "max_tokens": 2, "temperature": 0.0}
    part = "messages[0].content[1].image_url"
    try:
        async with http_client(llava_dir, allowed_media_domains=("images.example",)) as client:
            resp = await client.post(
                "/v1/chat/completions", json={**body, **_refused(f"http://127.0.0.1:{port}/a.png")}
            )
            assert_invalid_request(resp, 400, part, "host '127.0.0.1' is not one this server fetches from")
            assert handler.gets == 0
            resp = await client.post("/v1/chat/completions", json={**body, **_refused(_data_url(image))})
            assert resp.status_code == 200, resp.text
        async with http_client(llava_dir, allowed_media_domains=("127.0.0.1",)) as client:
            resp = await client.post(
                "/v1/chat/completions", json={**body, **_refused(f"http://127.0.0.1:{port}/a.png")}
            )
            assert resp.status_code == 200, resp.text
            resp = await client.post(
                "/v1/chat/completions", json={**body, **_refused(f"http://127.0.0.1:{port}/away")}
            )
            assert_invalid_request(resp, 400, part, "host 'localhost' is not one this server fetches from")
            assert handler.gets == 2  # the allowed fetch and the redirect; never localhost's
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _refused(url: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "Look:"}, _image_part(url)]
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


async def test_refusals_name_the_part(llava_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    part = "messages[0].content[1].image_url"
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 50)
    cases = [
        (_data_url(b"plain text, not a picture"), "not an image"),
        ("data:image/png;base64,%%%not-base64", "does not decode"),
        (_data_url(_png(1), "text/plain"), "not an image"),
        ("data:image/png,rawbytes", "not base64-encoded"),
        (_data_url(_png(1, (41, 50))), "PIL's decompression-bomb limit"),
        (_data_url(_png(1)[:60]), "could not be decoded"),
        ("file:///etc/passwd", "scheme is file:"),
        ("just-a-name.png", "without a scheme"),
    ]
    async with http_client(llava_dir, max_images_per_prompt=2) as http:
        for url, text in cases:
            assert_invalid_request(
                await http.post("/v1/chat/completions", json=_refused(url)), 400, part, text
            )
        at_limit = _refused(_data_url(_png(1)))
        assert (await http.post("/v1/chat/completions", json=at_limit)).status_code == 200
        # Three images for a limit of two: the third is named, before anything is fetched.
        content = [
            _image_part(_data_url(_png(1))),
            _image_part(_data_url(_png(2))),
            _image_part("http://x.invalid/"),
        ]
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        resp = await http.post("/v1/chat/completions", json=body)
        assert_invalid_request(resp, 400, "messages[0].content[2].image_url", "at most 2")
        assistant = {"role": "assistant", "content": [_image_part(_data_url(_png(1)))]}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, assistant]}
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and "only user messages carry image_url" in resp.text


async def test_tokenize_counts_each_images_placeholders_as_chat_does(
    llava_dir: pathlib.Path, offline: LLMEngine
) -> None:
    """/tokenize with the messages a chat request sends: the prompt the engine runs, each image's
    placeholders expanded (a client budgeting its context counts what chat's usage will say)."""
    images = [_png(1), _png(2), _png(3)]
    urls = [_data_url(data) for data in images]
    _, num_prompt = _offline_reply(offline, _messages(urls), images)
    async with http_client(llava_dir) as http:
        resp = await http.post("/tokenize", json={"model": "m", "messages": _messages(urls)})
        chat = await http.post(
            "/v1/chat/completions", json={"model": "m", "messages": _messages(urls), "max_tokens": 1}
        )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["count"] == len(body["tokens"]) == num_prompt == chat.json()["usage"]["prompt_tokens"]
    assert body["tokens"].count(IMAGE_TOKEN_ID) == 3 * NUM_IMAGE_TOKENS


async def test_a_text_only_model_refuses_image_parts(tiny_model_dir: pathlib.Path) -> None:
    async with http_client(tiny_model_dir) as http:
        body = {**_refused(_data_url(_png(1))), "model": tiny_model_dir.name}
        resp = await http.post("/v1/chat/completions", json=body)
    assert_invalid_request(resp, 400, "messages[0].content[1].image_url", "a text-only model")


async def test_responses_input_image_replies_as_chat(llava_dir: pathlib.Path, offline: LLMEngine) -> None:
    """/v1/responses' input_image parts (the official client's responses.create) reach the model
    as chat's image_url parts do; one without an image_url (a stored file's id) is a 400."""
    images = [_png(8), _png(9)]
    urls = [_data_url(data) for data in images]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                _image_part(urls[0]),
                {"type": "text", "text": "and"},
                _image_part(urls[1]),
            ],
        }
    ]
    expected, num_prompt = _offline_reply(offline, messages, images)
    content = [
        {"type": "input_text", "text": "Compare"},
        {"type": "input_image", "image_url": urls[0], "detail": "low"},
        {"type": "input_text", "text": "and"},
        {"type": "input_image", "image_url": urls[1]},
    ]
    async with openai_client(llava_dir) as client:
        response = await client.responses.create(
            model="m",
            input=[{"role": "user", "content": content}],  # type: ignore[list-item]
            max_output_tokens=MAX_NEW,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert response.output_text == expected
        assert response.usage is not None and response.usage.input_tokens == num_prompt
        with pytest.raises(openai.BadRequestError, match="stores no files"):
            await client.responses.create(
                model="m",
                input=[
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "file_id": "file-1", "detail": "auto"}],
                    }
                ],
            )
