"""Fixtures shared by tests/ and e2e/: generated tiny checkpoints (built once per session), and the
garbage collector given back its whole heap after a test that ran a serving command (which freezes
its startup heap: corral_cli.heap)."""

from __future__ import annotations

import gc
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping

import pytest
from corral_engine.demo_model import ARCHITECTURES, write_demo_model


class _LazyDirs(Mapping[str, pathlib.Path]):
    """name -> checkpoint dir; each is written (by `write(name, dir)`) on first access."""

    def __init__(
        self,
        root: pathlib.Path,
        names: Iterable[str],
        write: Callable[[str, pathlib.Path], pathlib.Path],
        known: dict[str, pathlib.Path] | None = None,
    ) -> None:
        self._root, self._names, self._write, self._dirs = root, tuple(names), write, dict(known or {})

    def __getitem__(self, name: str) -> pathlib.Path:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._dirs:
            self._dirs[name] = self._write(name, self._root / name)
        return self._dirs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny random-weight Llama checkpoint (float32, seed 0) with its tokenizer."""
    return write_demo_model(tmp_path_factory.mktemp("models") / "tiny-llama", preset="tiny", arch="llama")


@pytest.fixture(scope="session")
def tiny_model_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: pathlib.Path
) -> Mapping[str, pathlib.Path]:
    """arch -> tiny checkpoint dir for each demo architecture (each built when first used)."""
    return _LazyDirs(
        tmp_path_factory.mktemp("models-by-arch"),
        ARCHITECTURES,
        lambda arch, out: write_demo_model(out.with_name(f"tiny-{arch}"), preset="tiny", arch=arch),
        {"llama": tiny_model_dir},
    )


# The demo encoders' kinds: an embedding model, a one-label reranker, a three-label classifier, a
# five-label token classifier (last: a name is matched against the kinds from the last).
_ENCODER_KINDS = {
    "": {},
    "-reranker": {"is_reranker": True},
    "-classifier": {"num_labels": 3},
    "-token-classifier": {"num_labels": 5, "is_token_classifier": True},
}


def _write_encoder(name: str, out: pathlib.Path) -> pathlib.Path:
    from corral_engine.demo_encoder import write_demo_encoder

    arch, kind = next((name.removesuffix(k), k) for k in reversed(_ENCODER_KINDS) if name.endswith(k))
    return write_demo_encoder(out, arch=arch, **_ENCODER_KINDS[kind])


@pytest.fixture(scope="session")
def demo_encoders(tmp_path_factory: pytest.TempPathFactory) -> Mapping[str, pathlib.Path]:
    """name -> tiny encoder checkpoint (each built when first used): `bert` and `xlm-roberta`
    embedding models, `<arch>-reranker` (one label), `<arch>-classifier` (three labels) and
    `<arch>-token-classifier` (five labels a token)."""
    from corral_engine.demo_encoder import ENCODER_ARCHITECTURES

    names = [arch + kind for kind in _ENCODER_KINDS for arch in ENCODER_ARCHITECTURES]
    return _LazyDirs(tmp_path_factory.mktemp("encoders"), names, _write_encoder)


@pytest.fixture(autouse=True)
def _heap_unfrozen() -> Iterator[None]:
    """A serving command run in-process freezes the heap and sets gc thresholds; undo both."""
    thresholds = gc.get_threshold()
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
    gc.set_threshold(*thresholds)
