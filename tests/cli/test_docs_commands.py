"""Every `corral ...` command line in the docs parses: its subcommand exists, each flag is one that
subcommand's argparse parser defines, and a flag with fixed choices is shown with valid ones.
Prose about a flag's meaning is for a reader; this catches the flags that were renamed or never were."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from corral_cli.main import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    ROOT / "examples" / "README.md",
    ROOT / "charts" / "corral" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
# `corral` where a command starts: a code line (after `$ `, VAR=value assignments or a venv's bin/),
# an inline code span, or after a shell operator. Not `helm install corral charts/corral`.
_COMMAND = re.compile(
    r"(?:^\s*(?:\$\s+)?|`|&&\s*|\|\s+|;\s*|\$\()(?:[A-Z_]+=\S*\s+)*(?:[\w./-]*/)?corral(?=\s)"
)
# Where a command's text ends: the inline code span, a shell comment, a pipe or another command.
_END = re.compile(r"`|\s#\s|\s\|\s|;|&&|\$\(|\)")
_FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)(?:[ =]([^\s\]`]+))?")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _lines(path: Path) -> list[tuple[int, str]]:
    """(number, text) of each line, a shell continuation (trailing backslash) joined to the next."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.lstrip()
        pending = (number, line[:-1]) if line.endswith("\\") else None
        if pending is None:
            joined.append((number, line))
    return joined


def _commands(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, global options, subcommand, the rest) of each `corral` command line in `path`."""
    top = build_parser()._option_string_actions
    found = []
    for number, line in _lines(path):
        for match in _COMMAND.finditer(line):
            words = _END.split(line[match.end() :], maxsplit=1)[0].split()
            i = 0
            while i < len(words) and words[i].startswith("-"):  # global options, and their values
                action = top.get(words[i].split("=")[0])
                i += 2 if action is not None and action.nargs != 0 and "=" not in words[i] else 1
            # A lowercase word, as subcommands are: not "corral CLI:" in a diagram, nor "corral ...".
            if i < len(words) and re.fullmatch(r"[a-z][a-z0-9-]*", words[i]):
                found.append((number, " ".join(words[:i]), words[i], " ".join(words[i + 1 :])))
    return found


def _problems(option_strings: dict[str, argparse.Action], text: str) -> list[str]:
    problems = []
    for flag, value in _FLAG.findall(text):
        action = option_strings.get(flag)
        if action is None:
            problems.append(f"no flag {flag}")
            continue
        # `--preset tiny\|small` (a table cell) or `--kv-policy reserve`; placeholders (DIR) and
        # ellipses are not values.
        if action.choices is None or not value or not value[0].islower():
            continue
        for choice in re.split(r"\\?\|", value.strip("[]")):
            if choice and choice not in action.choices and choice.upper() != "...":
                problems.append(f"{flag} {choice}: not one of {sorted(action.choices)}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_parse(path: Path) -> None:
    subparsers = _subparsers()
    top = build_parser()._option_string_actions
    problems = []
    for number, global_options, command, rest in _commands(path):
        where = f"{path.relative_to(ROOT)}:{number}: corral {command}"
        if command not in SUBCOMMANDS:
            problems.append(f"{where}: no such subcommand")
            continue
        problems += [f"{where}: {p}" for p in _problems(top, global_options)]
        # After a lone `--`, flags for the engine `corral run-batch --model` starts.
        rest, _, engine_flags = f"{rest} ".partition(" -- ")
        problems += [f"{where}: {p}" for p in _problems(subparsers[command]._option_string_actions, rest)]
        problems += [
            f"{where}: engine {p}"
            for p in _problems(subparsers["engine"]._option_string_actions, engine_flags)
        ]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_commands_and_bad_flags(tmp_path: Path) -> None:
    """The extraction itself: a code line, a continued line, a table cell, and what it refuses."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "    corral up --demo \\\n      --port 8000   # a comment --not-a-flag\n"
        "| `corral demo-model DIR [--preset tiny\\|huge]` | x |\n"
        "HF_TOKEN=x .venv/bin/corral fetch-model hf://a/b --nope\n"
        "helm install corral charts/corral\n"
        "`corral --log-format json serve`, `corral check --base-url URL`\n"
    )
    commands = _commands(doc)
    found = [(n, c) for n, _, c, _ in commands]
    assert found == [(1, "up"), (3, "demo-model"), (4, "fetch-model"), (6, "serve"), (6, "check")]
    subparsers = _subparsers()
    up, demo, fetch = (subparsers[c[2]]._option_string_actions for c in commands[:3])
    assert _problems(up, commands[0][3]) == []
    assert _problems(demo, commands[1][3]) == ["--preset huge: not one of ['llama3-8b', 'small', 'tiny']"]
    assert _problems(fetch, commands[2][3]) == ["no flag --nope"]
