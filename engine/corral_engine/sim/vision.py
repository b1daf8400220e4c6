"""A simulated vision-language replica's images, built as the engine builds them: the checkpoint's
vision_config read and checked by the engine's rules (vision_config.py) and its own image processor
(image_processor.py). Both need transformers, so a vision checkpoint's replicas load it (and the
torch it imports), once a process; a text checkpoint's do not."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError
from corral_engine.image_processor import ImageProcessor
from corral_engine.sim.tokenizer import read_json_object
from corral_engine.vision_config import VISION_ARCHITECTURES, VisionConfig, load_vision_config


@dataclass(frozen=True, slots=True)
class SimVision:
    """What a replica of a vision-language checkpoint serves images with; one shared by the
    replicas of a process (the processor loads once, on the first image)."""

    images: ImageProcessor  # the server's `engine.images`: placeholders expanded, pixels hashed
    config: VisionConfig  # the tower the step-time model costs (sim/vision_cost.py)


def is_vision_checkpoint(model_dir: Path) -> bool:
    """Whether config.json's architectures name a vision-language model the engine serves."""
    architectures = read_json_object(model_dir / "config.json").get("architectures") or []
    return any(a in VISION_ARCHITECTURES for a in architectures)


def sim_vision(
    model_dir: Path, max_images: int, allowed_hosts: tuple[str, ...] | None = None
) -> SimVision | None:
    """The images of a replica of `model_dir` with --max-images-per-prompt `max_images` and
    --allowed-media-domains `allowed_hosts`; None for a text checkpoint. ModelLoadError where the
    engine refuses the checkpoint's vision side."""
    if not is_vision_checkpoint(model_dir):
        return None
    config_file = model_dir / "config.json"
    vision = load_vision_config(_transformers_config(model_dir), config_file)
    return SimVision(ImageProcessor(model_dir, vision, max_images, allowed_hosts), vision)


def _transformers_config(model_dir: Path) -> Any:
    """config.json as transformers reads it (its defaults filled in: a LLaVA config.json holds only
    what differs from them), as the engine's loader reads it."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    # StrictDataclassError: transformers v5 checks each field's type (a string for an int, ...).
    except (OSError, ValueError, KeyError, StrictDataclassError) as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: transformers cannot parse it: {e}") from e
