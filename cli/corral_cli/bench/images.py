"""Random images for benchmarking vision-language models: each chat request carries N fresh JPEG
images (seeded noise, as data: URLs), so no two requests share an image and the server's caches
see what distinct user images cost (vLLM's `random-mm` dataset is the same idea)."""

from __future__ import annotations

import base64
import io
import re
from dataclasses import replace

import numpy as np

from corral_cli.bench.workload import BenchRequest

_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
MAX_SIDE = 8192  # pixels; larger images are a test of the server's limits, not of its speed


def parse_size(text: str) -> tuple[int, int]:
    """(width, height) from `WxH`; ValueError naming the flag otherwise."""
    match = _SIZE.match(text.strip().lower())
    if match is None or max(int(match[1]), int(match[2])) > MAX_SIDE:
        limit = f"up to {MAX_SIDE}, e.g. 336x336"
        raise ValueError(f"--random-image-size expects WIDTHxHEIGHT {limit}; got {text!r}")
    return int(match[1]), int(match[2])


def random_image_url(rng: np.random.Generator, width: int, height: int) -> str:
    """A data: URL holding a JPEG of uniform noise, `width` x `height` pixels."""
    from PIL import Image

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)  # [H, W, RGB]
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def with_images(
    requests: list[BenchRequest], num_images: int, size: tuple[int, int], seed: int, variant: int = 0
) -> list[BenchRequest]:
    """`requests` each carrying `num_images` images of its own; `variant` gives another run of the
    same seed other images (as random prompts are fresh per run)."""
    try:
        import PIL  # noqa: F401
    except ImportError as e:
        raise ValueError("--random-images needs pillow (pip install 'corral[engine]' or pillow)") from e
    rng = np.random.default_rng([seed, variant, 0x1A6E])
    width, height = size
    return [
        replace(r, image_urls=tuple(random_image_url(rng, width, height) for _ in range(num_images)))
        for r in requests
    ]
