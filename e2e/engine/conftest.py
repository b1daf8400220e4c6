"""One shared `corral engine` process (tiny model, float32) for the e2e/engine tests."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.procs import EngineProcess, start_engine

# float32 so greedy text matches transformers exactly; a small pool keeps leaks visible in kv usage.
SHARED_ENGINE_FLAGS: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 64}


@pytest.fixture(scope="package")
def engine(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with start_engine(
        tiny_model_dir, log_dir=tmp_path_factory.mktemp("engine-logs"), **SHARED_ENGINE_FLAGS
    ) as e:
        yield e
