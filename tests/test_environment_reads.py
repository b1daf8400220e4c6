"""Configuration is read at the edge: no module of the three packages reads the environment except
the settings modules that build the typed, frozen settings objects (and the few allowed below)."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine/corral_engine", "gateway/corral_gateway", "operator/corral_operator")
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

# path -> why it may touch the environment.
ALLOWED = {
    "engine/corral_engine/settings.py": "the engine's settings (the CORRAL_* switches)",
    "gateway/corral_gateway/settings.py": "the gateway's settings",
    "operator/corral_operator/settings.py": "the operator's settings",
    # tokenizers has no Python API for its thread pool: it reads TOKENIZERS_PARALLELISM on each
    # call, so training is made single-threaded (and so reproducible) by setting it for the call.
    "engine/corral_engine/demo_tokenizer.py": "TOKENIZERS_PARALLELISM around tokenizer training",
}


def environment_reads(source: str) -> list[int]:
    """Line numbers where `source` names os.environ / os.getenv / environ.get and the like.

    Tokens, not the AST: comments and strings are tokens of their own, so they never count; and
    CPython 3.11.7's ast.parse can fail late in a long session ("AST constructor recursion depth
    mismatch"), which tokenizing cannot.
    """
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sorted({t.start[0] for t in tokens if t.type == tokenize.NAME and t.string in ENV_NAMES})


def test_the_detector_sees_every_spelling() -> None:
    assert environment_reads("import os\nx = os.environ.get('A')\n") == [2]
    assert environment_reads("import os\nx = os.getenv('A', '1')\n") == [2]
    assert environment_reads("import os\nos.environ['A'] = '1'\n") == [2]
    assert environment_reads("from os import environ\nx = environ.get('A')\n") == [1, 2]
    assert environment_reads("import os\nx = os.path.join('environ', 'b')  # os.environ\n") == []


@pytest.mark.parametrize("package", PACKAGES)
def test_only_edge_modules_read_the_environment(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        lines = environment_reads(path.read_text())
        if lines and relative not in ALLOWED:
            offenders.append(f"{relative}:{','.join(map(str, lines))}")
    assert not offenders, (
        "read the environment in a settings module and pass the value down; found: " + ", ".join(offenders)
    )


def test_the_allow_list_names_existing_modules() -> None:
    assert all((ROOT / path).is_file() for path in ALLOWED)
