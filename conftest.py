"""Fixtures shared by tests/ and e2e/: generated tiny checkpoints (built once per session), and the
garbage collector given back its whole heap after a test that ran a serving command (which freezes
its startup heap: corral_cli.heap)."""

from __future__ import annotations

import gc
import pathlib
from collections.abc import Iterator, Mapping

import pytest
from corral_engine.demo_model import ARCHITECTURES, write_demo_model


class _LazyModelDirs(Mapping[str, pathlib.Path]):
    """arch -> tiny checkpoint dir; each is written on first access."""

    def __init__(self, root: pathlib.Path, known: dict[str, pathlib.Path]) -> None:
        self._root, self._dirs = root, dict(known)

    def __getitem__(self, arch: str) -> pathlib.Path:
        if arch not in ARCHITECTURES:
            raise KeyError(arch)
        if arch not in self._dirs:
            self._dirs[arch] = write_demo_model(self._root / f"tiny-{arch}", preset="tiny", arch=arch)
        return self._dirs[arch]

    def __iter__(self) -> Iterator[str]:
        return iter(ARCHITECTURES)

    def __len__(self) -> int:
        return len(ARCHITECTURES)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny random-weight Llama checkpoint (float32, seed 0) with its tokenizer."""
    return write_demo_model(tmp_path_factory.mktemp("models") / "tiny-llama", preset="tiny", arch="llama")


@pytest.fixture(scope="session")
def tiny_model_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: pathlib.Path
) -> Mapping[str, pathlib.Path]:
    """arch -> tiny checkpoint dir for each demo architecture (each built when first used)."""
    return _LazyModelDirs(tmp_path_factory.mktemp("models-by-arch"), {"llama": tiny_model_dir})


@pytest.fixture(autouse=True)
def _heap_unfrozen() -> Iterator[None]:
    """A serving command run in-process freezes the heap and sets gc thresholds; undo both."""
    thresholds = gc.get_threshold()
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
    gc.set_threshold(*thresholds)
