"""Each engine option is declared once (corral_engine.args); everything derived from the declaration
must agree with it: `corral engine`'s flags, the CRD's spec.engine.args, the operator's command lines
for both engine kinds, and the docs' option table.

Sample values are generated from the declarations, so a new option is covered without editing here.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from corral_cli import cmd_engine
from corral_cli.chartgen import docs
from corral_cli.chartgen.__main__ import main as chartgen_main
from corral_cli.chartgen.files import stale_files
from corral_engine import args as engine_options
from corral_engine.args import DEFAULTS, OPTIONS, RULES, ArgumentError, EngineArgs, Exclusive
from corral_operator import crd, render
from corral_operator.engine_command import engine_args, vllm_args
from corral_operator.spec import SpecError, parse_spec

from tests.operator.invalid_cases import valid_spec

ROOT = Path(__file__).resolve().parents[1]
# One of each pair of mutually exclusive options is left out of the samples.
LEFT_OUT = {rule.second for rule in RULES if isinstance(rule, Exclusive)}


def sample(name: str) -> Any:
    """A valid value other than the default for option `name`."""
    option, default = OPTIONS[name], DEFAULTS.get(name)
    kind = engine_options.value_type(name)
    if option.choices is not None:
        return next(c for c in reversed(option.choices) if c != default)
    if kind is bool:
        return not default
    if option.is_bytes:
        return 256 << 20
    if option.is_power_of_two:
        return 32
    if kind is float:
        return 0.5 if default != 0.5 else 0.75
    if kind is int:
        return (option.ge or 0) + 2 if default != (option.ge or 0) + 2 else (option.ge or 0) + 3
    if engine_options.is_list(name):  # --lora-modules: NAME=PATH items
        return ("x=/adapters/x", "y=/adapters/y")
    if name == "pooler_config":  # a JSON object, checked as such
        return '{"pooling_type": "MEAN"}'
    return "/models/x" if name == "model" else "x"


def samples(names: list[str]) -> dict[str, Any]:
    return {n: sample(n) for n in names if n not in LEFT_OUT}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cmd_engine.add_arguments(p)
    return p


def crd_raw(names: list[str], kind: str = "corral") -> dict[str, Any]:
    """valid_spec() with spec.engine.args setting each of `names` to its sample, by CRD path."""
    raw = valid_spec()
    raw["engine"] = {"kind": kind, "image": "engine:test", "args": {}}
    raw["resources"] = {"gpu": 1}  # a GPU pod: every option applies
    for name, value in samples(names).items():
        node = raw["engine"]["args"]
        *parents, last = OPTIONS[name].crd.split(".")  # type: ignore[union-attr]
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = f"{value >> 20}Mi" if OPTIONS[name].is_bytes else value
    return raw


def test_every_option_has_a_flag_with_its_choices_and_type() -> None:
    actions = {a.dest: a for a in parser()._actions}
    for name, option in OPTIONS.items():
        action = actions[name]
        assert action.option_strings == [engine_options.cli_flag(name)], name
        assert (tuple(action.choices) if action.choices else None) == option.choices, name
        assert option.help in (action.help or ""), name
    for rule in RULES:
        if isinstance(rule, Exclusive):
            argv = [
                "--model",
                "m",
                engine_options.cli_flag(rule.first),
                "1",
                engine_options.cli_flag(rule.second),
                "1",
            ]
            with pytest.raises(SystemExit):
                parser().parse_args(argv)


def test_every_option_round_trips_through_the_flags() -> None:
    args = EngineArgs(**samples(list(OPTIONS)))
    assert all(getattr(args, n) != DEFAULTS.get(n) for n in OPTIONS if n not in LEFT_OUT)
    assert cmd_engine.engine_args_from(parser().parse_args(args.to_cli_args())) == args


def test_bounds_are_enforced_by_the_engine() -> None:
    for name, option in OPTIONS.items():
        if option.ge is not None:
            with pytest.raises(ArgumentError, match=name):
                EngineArgs(model="m").replace(**{name: option.ge - 1})
        if option.le is not None:
            with pytest.raises(ArgumentError, match=name):
                EngineArgs(model="m").replace(**{name: option.le + 1})
        if option.choices is not None:
            with pytest.raises(ArgumentError, match=name):
                EngineArgs(model="m").replace(**{name: "no-such-choice"})


# A value of the wrong type for each kind of option (an int that is not whole, a number as text).
_WRONG = {int: ("8", 2.5, True), float: ("0.5", False), bool: ("yes", 1), str: (5, ["m"])}
_WRONG_LIST = ("x=/a", [5])  # a list option takes a list of str, not one str


def test_every_option_refuses_a_value_of_the_wrong_type_naming_it() -> None:
    """Checked against the declaration's type: range checks alone let `max_model_len="100"`
    through to fail inside the engine."""
    for name in OPTIONS:
        wrong = _WRONG_LIST if engine_options.is_list(name) else _WRONG[engine_options.value_type(name)]
        for value in wrong:
            with pytest.raises(ArgumentError, match=f"^{name} must be .*, got {type(value).__name__}"):
                EngineArgs(model="m").replace(**{name: value})


def test_options_take_numbers_and_paths_as_python_holds_them() -> None:
    args = EngineArgs(model=Path("/models/m"), gpu_memory_utilization=1)  # type: ignore[arg-type]
    assert args.model == "/models/m" and type(args.gpu_memory_utilization) is float
    with pytest.raises(ArgumentError, match="model must be str, got NoneType"):
        EngineArgs(model=None)  # type: ignore[arg-type]


def _crd_args_schema() -> dict[str, Any]:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["properties"]["engine"]["properties"]["args"]


def _crd_fields(schema: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, prop in schema["properties"].items():
        if "properties" in prop:
            out |= _crd_fields(prop, f"{prefix}{key}.")
        else:
            out[prefix + key] = prop
    return out


def test_the_crd_has_exactly_the_declared_fields_with_their_bounds() -> None:
    fields = _crd_fields(_crd_args_schema())
    declared = {o.crd: n for n, o in OPTIONS.items() if o.crd is not None}
    assert set(fields) == set(declared)
    for path, name in declared.items():
        option, prop = OPTIONS[name], fields[path]
        assert prop.get("enum") == (list(option.choices) if option.choices else None), path
        assert prop.get("minimum") == (None if option.is_bytes else option.ge), path
        assert prop.get("maximum") == (None if option.is_bytes else option.le), path
        if engine_options.is_list(name):  # an array of the option's item type
            assert prop["type"] == "array" and prop["items"]["type"] == "string", path
            continue
        assert (
            prop["type"]
            == {bool: "boolean", int: "integer", float: "number", str: "string"}[
                str if option.is_bytes else engine_options.value_type(name)
            ]
        ), path


def test_the_crd_states_the_engines_two_option_rules_as_cel() -> None:
    rules = json.dumps(_crd_args_schema())
    for rule in RULES:
        leaves = [OPTIONS[n].crd.rsplit(".", 1)[-1] for n in rule.names]  # type: ignore[union-attr]
        assert all(f"has(self.{leaf})" in rules for leaf in leaves), rule


def test_corral_command_carries_every_crd_option() -> None:
    names = [n for n, o in OPTIONS.items() if o.crd is not None]
    spec = parse_spec(crd_raw(names))
    command = render.engine_container(spec)["command"]
    assert command[:2] == ["corral", "engine"]
    parsed = cmd_engine.engine_args_from(parser().parse_args(command[2:]))
    expected = EngineArgs(model=parsed.model, served_model_name=spec.model.name, **samples(names))
    assert parsed == expected


def test_vllm_command_carries_every_option_with_a_vllm_equivalent() -> None:
    names = [n for n, o in OPTIONS.items() if o.crd is not None and o.vllm is not None]
    argv = render.engine_container(parse_spec(crd_raw(names, kind="vllm")))["args"]
    json_flags: dict[str, dict[str, Any]] = {}
    for name, value in samples(names).items():
        vllm = OPTIONS[name].vllm
        assert vllm is not None
        if vllm.json_key is not None:
            json_flags.setdefault(vllm.flag, json.loads(argv[argv.index(vllm.flag) + 1]))
            assert json_flags[vllm.flag][vllm.json_key] == value, name
        elif isinstance(value, bool):
            assert (vllm.flag if value else "--no-" + vllm.flag[2:]) in argv, name
        elif isinstance(value, tuple):  # a list option: its items after the one flag
            start = argv.index(vllm.flag) + 1
            assert tuple(argv[start : start + len(value)]) == value, name
        else:
            assert argv[argv.index(vllm.flag) + 1] == str(value), name
            assert all(flag in argv for flag in vllm.also), name


@pytest.mark.parametrize("name", [n for n, o in OPTIONS.items() if o.crd is not None and o.vllm is None])
def test_corral_only_options_are_refused_for_vllm(name: str) -> None:
    with pytest.raises(SpecError, match="corral engine options"):
        parse_spec(crd_raw([name], kind="vllm"))


def test_the_engine_refusing_a_combination_is_a_spec_error() -> None:
    raw = crd_raw([])
    raw["engine"]["args"] = {"speculative": {"promptLookupMin": 5}}  # above the default max of 3
    with pytest.raises(SpecError, match="prompt_lookup_min"):
        engine_args(parse_spec(raw), "/models")
    with pytest.raises(SpecError, match="prompt_lookup_min"):
        vllm_args(parse_spec(copy.deepcopy(raw)), "/models", 8000)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512", 512), ("4Gi", 4 << 30), ("2M", 2_000_000), ("512MiB", 512 << 20), ("1.5Gi", 3 << 29)],
)
def test_one_byte_size_grammar(text: str, expected: int) -> None:
    assert engine_options.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "1gi", "512m", "-1", "1.2.3G", ""])
def test_byte_sizes_outside_the_grammar_are_refused(text: str) -> None:
    with pytest.raises(ArgumentError, match="not a byte size"):
        engine_options.parse_bytes(text)


def test_the_docs_table_is_current_and_lists_every_option(tmp_path: Path) -> None:
    assert docs.DOC not in stale_files(ROOT)
    table = docs.options_table()
    assert all(f"`{engine_options.cli_flag(n)}" in table for n in OPTIONS)
    doc = tmp_path / docs.DOC
    doc.parent.mkdir(parents=True)
    doc.write_text((ROOT / docs.DOC).read_text().replace("| `--seed N`", "| `--seed K`"))
    assert docs.DOC in stale_files(tmp_path)
    assert chartgen_main(["--root", str(tmp_path)]) == 0
    assert docs.DOC not in stale_files(tmp_path)
