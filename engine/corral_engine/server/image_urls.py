"""A chat request's image URLs read into PIL images: `data:` URLs decoded, http(s) ones fetched
(httpx, bounded in time, bytes and redirects); each refusal a 400 naming the content part."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import urllib.parse
from dataclasses import dataclass
from typing import Any

import httpx

from corral_engine.server import errors

# OpenAI's per-image limit; a fetched body past it is cut off and refused.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# vLLM's image fetch timeout (VLLM_IMAGE_FETCH_TIMEOUT) is 5 s; connecting gets that, the whole
# fetch (a server dripping bytes resets httpx's per-read timeout) twice that.
FETCH_CONNECT_TIMEOUT_S = 5.0
FETCH_TOTAL_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
_FETCH_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image content part: its URL and the part's name in the request (the 400's param)."""

    url: str
    param: str


class HostNotAllowed(httpx.HTTPError):
    """A URL (or a redirect) names a host outside --allowed-media-domains."""


async def load_images(refs: list[ImageRef], allowed_hosts: tuple[str, ...] | None = None) -> list[Any]:
    """The PIL images of `refs`, in order (fetched concurrently, decoded off the event loop);
    `allowed_hosts`: the only hosts an http(s) URL or a redirect may name (None: any)."""
    if not any(_scheme(ref.url) in ("http", "https") for ref in refs):
        return [await asyncio.to_thread(_decode, _data_url_bytes(ref), ref) for ref in refs]
    allowed = None if allowed_hosts is None else {h.lower().rstrip(".") for h in allowed_hosts}
    for ref in refs:  # refused before anything is fetched
        host = urllib.parse.urlsplit(ref.url).hostname or ""
        if _scheme(ref.url) in ("http", "https") and allowed is not None and host not in allowed:
            raise errors.invalid_request(_not_allowed(host), ref.param)

    async def check_host(request: httpx.Request) -> None:  # a redirect's target too
        if allowed is not None and request.url.host.lower().rstrip(".") not in allowed:
            raise HostNotAllowed(_not_allowed(request.url.host))

    timeout = httpx.Timeout(FETCH_TOTAL_TIMEOUT_S, connect=FETCH_CONNECT_TIMEOUT_S)
    client = httpx.AsyncClient(
        timeout=timeout,
        follow_redirects=True,
        max_redirects=MAX_REDIRECTS,
        event_hooks={"request": [check_host]},
    )
    async with client:
        return list(await asyncio.gather(*(_load(client, ref) for ref in refs)))


def _not_allowed(host: str) -> str:
    return f"The image URL's host {host!r} is not one this server fetches from (--allowed-media-domains)."


async def _load(client: httpx.AsyncClient, ref: ImageRef) -> Any:
    if _scheme(ref.url) in ("http", "https"):
        data = await _fetch(client, ref)
    else:
        data = _data_url_bytes(ref)
    return await asyncio.to_thread(_decode, data, ref)


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].strip().lower() if ":" in url else ""


def _data_url_bytes(ref: ImageRef) -> bytes:
    """A `data:image/...;base64,...` URL's bytes; file:// and other schemes are refused."""
    scheme = _scheme(ref.url)
    if scheme != "data":
        shown = f"{scheme}:" if scheme else "a URL without a scheme"
        raise errors.invalid_request(
            f"The image URL's scheme is {shown}; images are given as data: URLs (base64) or http(s) URLs.",
            ref.param,
        )
    head, sep, payload = ref.url[len("data:") :].partition(",")
    media_type, *params = head.split(";")
    if not sep or "base64" not in (p.strip().lower() for p in params):
        raise errors.invalid_request(
            "The data: URL is not base64-encoded (data:image/png;base64,...).", ref.param
        )
    if media_type and not media_type.strip().lower().startswith("image/"):
        raise errors.invalid_request(f"The data: URL's media type {media_type!r} is not an image.", ref.param)
    try:
        return base64.b64decode(urllib.parse.unquote(payload), validate=True)
    except (binascii.Error, ValueError) as e:
        raise errors.invalid_request(f"The data: URL's base64 does not decode: {e}", ref.param) from None


async def _fetch(client: httpx.AsyncClient, ref: ImageRef) -> bytes:
    """The body at an http(s) URL, at most MAX_IMAGE_BYTES, within FETCH_TOTAL_TIMEOUT_S."""
    try:
        async with asyncio.timeout(FETCH_TOTAL_TIMEOUT_S):
            return await _read_body(client, ref)
    except TimeoutError:
        reason = f"it took longer than {FETCH_TOTAL_TIMEOUT_S:g} s"
    except httpx.TooManyRedirects:
        reason = f"it redirected more than {MAX_REDIRECTS} times"
    except HostNotAllowed as e:
        raise errors.invalid_request(str(e), ref.param) from None
    except httpx.HTTPError as e:
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    raise errors.invalid_request(f"The image could not be fetched: {reason}.", ref.param)


async def _read_body(client: httpx.AsyncClient, ref: ImageRef) -> bytes:
    async with client.stream("GET", ref.url) as response:
        if response.status_code != 200:
            raise errors.invalid_request(
                f"The image could not be fetched: its server answered {response.status_code}.", ref.param
            )
        body = bytearray()
        async for chunk in response.aiter_bytes(_FETCH_CHUNK_BYTES):
            body += chunk
            if len(body) > MAX_IMAGE_BYTES:
                raise errors.invalid_request(
                    f"The image at the URL is larger than {MAX_IMAGE_BYTES} bytes.", ref.param
                )
        return bytes(body)


def _decode(data: bytes, ref: ImageRef) -> Any:
    """A PIL image of `data`, loaded; 400 for what PIL cannot read and past PIL's decompression-bomb
    limit (Image.MAX_IMAGE_PIXELS, 89.5 Mpixels, as vLLM leaves it), checked before decoding."""
    from PIL import Image, UnidentifiedImageError

    limit = Image.MAX_IMAGE_PIXELS
    too_large = f"more pixels than the {limit} this server decodes (PIL's decompression-bomb limit)"
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if limit is not None and opened.width * opened.height > limit:
                raise errors.invalid_request(
                    f"The image is {opened.width}x{opened.height}: {too_large}.", ref.param
                )
            opened.load()
            return opened.copy()
    except UnidentifiedImageError:
        raise errors.invalid_request(
            "The data is not an image in a format the server reads.", ref.param
        ) from None
    except Image.DecompressionBombError:  # PIL's own check, at twice the limit, as it opens
        raise errors.invalid_request(f"The image has {too_large}.", ref.param) from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise errors.invalid_request(f"The image could not be decoded: {e}", ref.param) from None
