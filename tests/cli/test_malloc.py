"""tcmalloc for engine processes: found where installed, preloaded by `corral up`, reported by
`corral engine`, switched off by CORRAL_TCMALLOC=0; and PyTorch's huge pages switch."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from corral_cli import local_engines, malloc


@pytest.fixture
def libdir(tmp_path: Path) -> Path:
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return tmp_path


def test_finds_the_library_in_the_first_directory_that_has_it(tmp_path: Path, libdir: Path) -> None:
    assert malloc.find_tcmalloc([tmp_path / "none", libdir]) == libdir / "libtcmalloc_minimal.so.4"
    assert malloc.find_tcmalloc([tmp_path / "none"]) is None


def test_engine_env_preloads_it_once_and_keeps_other_preloads(libdir: Path) -> None:
    lib = str(libdir / "libtcmalloc_minimal.so.4")
    env = malloc.engine_env({"PATH": "/bin"}, [libdir])
    assert env["LD_PRELOAD"] == lib and env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    with_other = malloc.engine_env({"LD_PRELOAD": "/x/libiomp5.so"}, [libdir])
    assert with_other["LD_PRELOAD"] == f"{lib}:/x/libiomp5.so"
    assert malloc.engine_env(env, [libdir]) == env  # already there


def test_engine_env_preloads_nothing_when_off_or_missing(tmp_path: Path, libdir: Path) -> None:
    assert "LD_PRELOAD" not in malloc.engine_env({"CORRAL_TCMALLOC": "0"}, [libdir])
    assert malloc.engine_env({"A": "1"}, [tmp_path / "none"]) == {"A": "1", malloc.THP_ENV: "1"}


def test_is_loaded_reads_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not malloc.is_loaded(maps)
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/local/lib/libtcmalloc_minimal.so.4\n")
    assert malloc.is_loaded(maps)
    assert not malloc.is_loaded(tmp_path / "missing")


def test_advice_warns_only_when_installed_but_not_preloaded(libdir: Path) -> None:
    lib = libdir / "libtcmalloc_minimal.so.4"
    assert malloc.advice(True, lib)[0] == logging.INFO
    level, message = malloc.advice(False, lib)
    assert level == logging.WARNING and f"LD_PRELOAD={lib}" in message
    level, message = malloc.advice(False, None)
    assert level == logging.INFO and "libtcmalloc-minimal4" in message


def test_corral_up_starts_engines_with_tcmalloc_preloaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, libdir: Path
) -> None:
    started: dict[str, Any] = {}

    def fake_popen(argv: list[str], **kwargs: Any) -> object:
        started.update(kwargs, argv=argv)
        return object()

    monkeypatch.setattr(malloc, "LIB_DIRS", (libdir,))
    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("CORRAL_TCMALLOC", raising=False)
    local_engines.LocalEngine(["--model", "m"], 1, tmp_path, ["--log-format", "json"])
    assert started["env"]["LD_PRELOAD"] == str(libdir / "libtcmalloc_minimal.so.4")
    assert "engine" in started["argv"]
    # The fleet's logging options reach the engines.
    assert started["argv"][started["argv"].index("--log-format") + 1] == "json"


def test_engines_ask_for_huge_pages_unless_told_otherwise(tmp_path: Path) -> None:
    assert malloc.engine_env({}, [tmp_path])[malloc.THP_ENV] == "1"
    assert malloc.engine_env({malloc.THP_ENV: "0"}, [tmp_path])[malloc.THP_ENV] == "0"
    # with tcmalloc switched off too: the two settings are independent
    assert malloc.engine_env({"CORRAL_TCMALLOC": "0"}, [tmp_path])[malloc.THP_ENV] == "1"


def test_corral_engine_sets_the_switch_before_torch_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from corral_cli import cmd_engine

    environ: dict[str, str] = {}  # what it sets stays out of this process's environment
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    monkeypatch.setattr("torch.set_num_interop_threads", lambda n: None)
    cmd_engine._set_torch_threads(1)
    assert environ[malloc.THP_ENV] == "1"
    assert environ["OMP_WAIT_POLICY"] == "PASSIVE" and environ["GOMP_SPINCOUNT"] == "10000"
    environ[malloc.THP_ENV] = "0"
    environ["GOMP_SPINCOUNT"] = "0"
    cmd_engine._set_torch_threads(1)
    assert environ[malloc.THP_ENV] == "0" and environ["GOMP_SPINCOUNT"] == "0"  # the user's choice stands


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("garbage\n", None),
    ],
)
def test_thp_mode_reads_the_bracketed_choice(tmp_path: Path, text: str, mode: str | None) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    assert malloc.thp_mode(path) == mode
    assert malloc.thp_mode(tmp_path / "missing") is None


def test_huge_pages_advice_says_what_the_engine_runs_on() -> None:
    assert "transparent huge pages" in malloc.huge_pages_advice("1", "madvise")[1]
    assert "off (never)" in malloc.huge_pages_advice("1", "never")[1]
    assert "4 KiB pages (THP_MEM_ALLOC_ENABLE=0)" in malloc.huge_pages_advice("0", "madvise")[1]
    assert "unset" in malloc.huge_pages_advice(None, "always")[1]
