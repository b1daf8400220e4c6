"""The LoRA adapters of `corral up -f`: fetched into the local model cache, checked, and handed to
the engines as the operator renders them for pods (`--enable-lora --lora-modules NAME=DIR ...`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from corral_engine.lora import read_adapter_config
from corral_engine.sources import FetchError

from corral_cli.cmd_fetch_model import fetch

if TYPE_CHECKING:
    from corral_operator.local import LocalFleet


class AdapterFetchError(FetchError):
    """An adapter that cannot be fetched; its kind (and so the exit code) is the fetch's."""


def adapter_flags(fleet: LocalFleet) -> list[str]:
    """The engine flags serving `fleet`'s adapters, each fetched (once, here, with its progress on
    this terminal) and checked as the engine checks it: a bad one is said before any engine starts."""
    from corral_operator.engine_command import lora_module_flags  # as corral_operator.local: with -f only

    paths = []
    for name, uri in fleet.adapters:
        try:
            # The model's code path: the same cache as `corral engine --model` and `fetch-model`.
            path = str(fetch(uri, s3_endpoint=fleet.s3_endpoint).path)
        except FetchError as e:
            raise AdapterFetchError(e.kind, f"adapter {name!r} of {fleet.name}: {e}") from e
        # An AdapterError (a ValueError) naming the adapter: no adapter_config.json, too large a rank.
        read_adapter_config(name, path, fleet.engine_args.max_lora_rank)
        paths.append((name, path))
    return lora_module_flags(paths)
