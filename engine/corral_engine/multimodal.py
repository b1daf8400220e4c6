"""A prompt's images (vLLM's offline `multi_modal_data`): their pixel values, each image's span of
placeholder tokens in the prompt, and a content hash the prefix cache keys blocks by. No torch or
transformers (the image processor is image_processor.py): requests and the core read it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import numpy as np

from corral_engine.errors import InvalidRequestError


class MultiModalPrompt(TypedDict, total=False):
    """A prompt with images: `prompt` (text) or `prompt_token_ids`, and `multi_modal_data`
    ({"image": a PIL image or a list of them}); each image has one `<image>` placeholder in the
    prompt, or its placeholder tokens already expanded."""

    prompt: str
    prompt_token_ids: list[int]
    multi_modal_data: dict[str, Any]


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    """One image of a request: what the vision tower reads and where its rows go."""

    # [C, H, W] float32 as the image processor made it; Qwen-VL: [patches, C * T * P * P]
    pixel_values: np.ndarray
    offset: int  # the first placeholder token's index in the prompt
    length: int  # placeholder tokens (= the embedding rows the image becomes)
    content_hash: bytes  # of the pixel values: equal images share prefix-cache blocks
    grid_thw: tuple[int, int, int] | None = None  # Qwen-VL: the image's patch grid (image_grid_thw)

    @property
    def end(self) -> int:
        return self.offset + self.length


class ImagePrompts(Protocol):
    """What builds a prompt's images (image_processor.ImageProcessor): placeholders expanded, pixel
    values made, and which token is the placeholder."""

    image_token_id: int
    max_images: int  # per prompt (--max-images-per-prompt)
    allowed_hosts: tuple[str, ...] | None  # the hosts image URLs may name (None: any)

    def build(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], tuple[ImageInput, ...]]: ...


def prompt_of(prompt: Any) -> str | list[int]:
    """The text or token ids of a prompt (a MultiModalPrompt's one of `prompt`, `prompt_token_ids`)."""
    if not isinstance(prompt, dict):
        return prompt  # type: ignore[no-any-return]
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if (text is None) == (ids is None):
        raise InvalidRequestError("a prompt dict takes one of 'prompt' and 'prompt_token_ids'", "prompt")
    return text if isinstance(text, str) else list(ids or ())


def with_images(
    prompt: Any, token_ids: list[int], images: ImagePrompts | None, model_name: str
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt's token ids (placeholders expanded) and its images from `multi_modal_data`;
    InvalidRequestError when they do not fit the prompt, or the model takes no images."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    found = [] if data is None else images_of(data)
    if images is None:
        if found:
            raise InvalidRequestError(
                f"{model_name} is not a vision-language model: it takes no images", "multi_modal_data"
            )
        return token_ids, ()
    return images.build(token_ids, found)


def check_images(
    token_ids: list[int], mm_inputs: tuple[ImageInput, ...], images: ImagePrompts | None, model_name: str
) -> None:
    """Images processed elsewhere (the server's side of the engine core), checked against the prompt."""
    if images is None:
        if mm_inputs:
            raise InvalidRequestError(
                f"{model_name} is not a vision-language model: it takes no images", "multi_modal_data"
            )
        return
    check_num_images(len(mm_inputs), images.max_images)
    token = images.image_token_id
    is_placed = all(
        m.end <= len(token_ids) and token_ids[m.offset : m.end] == [token] * m.length for m in mm_inputs
    )
    if not is_placed or sum(m.length for m in mm_inputs) != token_ids.count(token):
        raise InvalidRequestError(
            "the images do not match the prompt's placeholder tokens", "multi_modal_data"
        )


def check_num_images(num_images: int, max_images: int, param: str = "multi_modal_data") -> None:
    """InvalidRequestError past --max-images-per-prompt (vLLM's --limit-mm-per-prompt image=N)."""
    if num_images > max_images:
        raise InvalidRequestError(
            f"the prompt has {num_images} images; this engine takes at most {max_images} a prompt "
            f"(--max-images-per-prompt)",
            param,
        )


def content_hash(pixel_values: np.ndarray) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str((pixel_values.shape, pixel_values.dtype.str)).encode())
    digest.update(np.ascontiguousarray(pixel_values).tobytes())
    return digest.digest()


def images_of(data: Any) -> list[Any]:
    """The PIL images of `multi_modal_data`; InvalidRequestError for anything else."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        kinds = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise InvalidRequestError(f"multi_modal_data takes only 'image' (got {kinds})", "multi_modal_data")
    from PIL import Image

    images = data.get("image", [])
    images = images if isinstance(images, list | tuple) else [images]
    for image in images:
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(
                f"multi_modal_data['image'] takes PIL images, got {type(image).__name__}", "multi_modal_data"
            )
    return list(images)


def expand_placeholders(
    token_ids: list[int], num_images: int, image_token_id: int, num_image_tokens: int | list[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids, (offset, length) per image): one placeholder per image is expanded to
    `num_image_tokens` (one count for every image, or each image's own); runs already that long
    are kept. InvalidRequestError when the counts differ or a run has another length."""
    counts = num_image_tokens if isinstance(num_image_tokens, list) else [num_image_tokens] * num_images
    runs: list[tuple[int, int]] = []  # (start, length) of each run of placeholder tokens
    i = 0
    while i < len(token_ids):
        if token_ids[i] == image_token_id:
            start = i
            while i < len(token_ids) and token_ids[i] == image_token_id:
                i += 1
            runs.append((start, i - start))
        else:
            i += 1
    if len(runs) == num_images and [length for _, length in runs] == counts:
        return list(token_ids), runs
    if sum(length for _, length in runs) != num_images or any(length != 1 for _, length in runs):
        found = sum(length for _, length in runs)
        expanded = num_image_tokens if isinstance(num_image_tokens, int) else "its own count of"
        raise InvalidRequestError(
            f"the prompt has {found} image placeholder tokens for {num_images} image(s): each image "
            f"needs one placeholder (or {expanded} placeholder tokens in a row)",
            "multi_modal_data",
        )
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    last = 0
    for (start, _), count in zip(runs, counts, strict=True):
        out.extend(token_ids[last:start])
        spans.append((len(out), count))
        out.extend([image_token_id] * count)
        last = start + 1
    out.extend(token_ids[last:])
    return out, spans
