"""Dockerfiles (not built here: no Docker engine): parsed with BuildKit's parser, multi-stage,
non-root as the chart's pods expect, copying files that exist, installing extras that exist, and
starting a command line the corral CLI accepts."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dockerfile
import pytest
from corral_cli import malloc
from corral_cli.main import build_parser

from tests.chart.conftest import ROOT, find
from tests.test_packaging import declared_requirements

DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
UID = 10001


def _final_stage(path: Path) -> list[Any]:
    commands = list(dockerfile.parse_file(str(path)))
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    return commands[last_from:]


def test_every_image_has_a_dockerfile() -> None:
    names = {p.name for p in DOCKERFILES}
    assert names == {
        "engine.Dockerfile",
        "engine-cuda.Dockerfile",
        "gateway.Dockerfile",
        "operator.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_and_non_root(path: Path) -> None:
    commands = list(dockerfile.parse_file(str(path)))
    assert sum(c.cmd == "FROM" for c in commands) >= 2, "not multi-stage"
    final = _final_stage(path)
    (user,) = [c.value[0] for c in final if c.cmd == "USER"]
    assert user == str(UID)
    assert any(c.cmd == "COPY" and "--from=build" in c.flags for c in final)
    assert not any(c.cmd == "RUN" and "pip install" in c.value[0] for c in final), (
        "build tools in the runtime"
    )


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copies_existing_files_and_installs_existing_extras(path: Path) -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "COPY" and not command.flags:
            for source in command.value[:-1]:
                assert (ROOT / source).exists(), f"{path.name} copies missing {source}"
    for extra in _installed_extras(path):
        assert extra in extras, f"{path.name} installs unknown extra {extra}"
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.is_file(), f"{path.name} has no {ignore.name}"


def _installed_extras(path: Path) -> list[str]:
    """The corral extras the Dockerfile's `pip install ".[extra,...]"` lines name."""
    return [
        extra.strip()
        for command in dockerfile.parse_file(str(path))
        if command.cmd == "RUN" and "pip install" in command.value[0] and '".[' in command.value[0]
        for extra in command.value[0].split('".[', 1)[1].split("]", 1)[0].split(",")
    ]


@pytest.mark.parametrize(
    "path", [p for p in DOCKERFILES if not p.name.startswith("operator")], ids=lambda p: p.name
)
def test_http_images_get_uvicorns_fast_loop_and_parser(path: Path) -> None:
    """Without uvloop and httptools, uvicorn falls back to asyncio's loop and the pure-Python h11
    parser, and the engine streams ~14% fewer tokens per second (docs/engine-speed.md, item 8)."""
    extras = _installed_extras(path)
    assert any({"uvicorn", "uvloop", "httptools"} <= declared_requirements(extra) for extra in extras)


@pytest.mark.parametrize(
    "path", [p for p in DOCKERFILES if not p.name.startswith("operator")], ids=lambda p: p.name
)
def test_http_images_can_send_traces(path: Path) -> None:
    """--otlp-traces-endpoint in the chart's pods needs the SDK and its exporter (docs/operations.md)."""
    assert "tracing" in _installed_extras(path)


def test_cpu_engine_image_preloads_the_tcmalloc_it_installs_and_asks_for_huge_pages() -> None:
    final = _final_stage(ROOT / "docker" / "engine.Dockerfile")
    env: dict[str, str] = {}
    for command in final:
        if command.cmd == "ENV":
            env.update(zip(command.value[::2], command.value[1::2], strict=True))
    preload = Path(env["LD_PRELOAD"])
    installs = [c.value[0] for c in final if c.cmd == "RUN" and "libtcmalloc-minimal4" in c.value[0]]
    assert installs and f" {preload} " in f"{installs[0]} ", "LD_PRELOAD names a file the image does not make"
    assert preload.parent in malloc.LIB_DIRS, "corral up / corral engine would not find it"
    assert env.get(malloc.THP_ENV) == "1", "tensors on huge pages (docs/engine-speed.md, item 12)"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_default_command_is_a_valid_corral_command_line(path: Path) -> None:
    final = _final_stage(path)
    (entrypoint,) = [c.value for c in final if c.cmd == "ENTRYPOINT"]
    (cmd,) = [c.value for c in final if c.cmd == "CMD"]
    assert entrypoint == ("corral",)
    args = build_parser().parse_args(list(cmd))
    assert args.command == path.name.split(".")[0].split("-")[0]


def test_chart_pods_run_as_the_images_user(rendered: Callable[[str], list[dict[str, Any]]]) -> None:
    for deployment in find(rendered("default"), "Deployment"):
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == UID
