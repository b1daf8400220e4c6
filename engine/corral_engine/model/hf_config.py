"""transformers' parse of a checkpoint's config.json (AutoConfig, from local files only), what it
cannot parse said as a ModelLoadError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError


def auto_config(path: Path) -> Any:
    """The transformers config of the checkpoint in `path`; ModelLoadError naming why it fails."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    # StrictDataclassError: transformers v5 checks each field's type (e.g. a string for an int).
    except (OSError, ValueError, KeyError, StrictDataclassError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: transformers cannot parse it: {e}") from e
