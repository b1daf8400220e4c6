"""--max-cpu-loras: at most that many adapters' weights stay in host memory, the least recently used
dropped first; a request for a dropped adapter reads it again from its path (the same tokens), and
one whose files are gone by then is refused with a clear error instead of failing the step."""

from __future__ import annotations

import pathlib
import shutil

import pytest
from corral_engine.args import ArgumentError, EngineArgs
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.errors import InvalidRequestError
from corral_engine.lora import LoraRequest
from corral_engine.sampling_params import SamplingParams

from tests.engine.helpers import make_engine, random_prompts, run_checked

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def adapter_dirs(
    tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("host-adapters")
    return {
        name: write_demo_adapter(tiny_model_dir, root / name, rank=4, seed=i + 1)
        for i, name in enumerate(NAMES)
    }


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompts(1, 500, seed=3)[0]


def _engine(model_dir: pathlib.Path, dirs: dict[str, pathlib.Path], **kwargs: object):  # type: ignore[no-untyped-def]
    modules = tuple(f"{name}={path}" for name, path in dirs.items())
    return make_engine(model_dir, enable_lora=True, lora_modules=modules, max_loras=1, **kwargs)


def _loras(dirs: dict[str, pathlib.Path]) -> dict[str, LoraRequest]:
    return {name: LoraRequest(name, i, str(path)) for i, (name, path) in enumerate(dirs.items(), start=1)}


def _run(engine, prompt: list[int], lora: LoraRequest, request_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    engine.add_request(request_id, prompt, GREEDY, lora=lora)
    return run_checked(engine)[request_id]


def test_max_cpu_loras_defaults_to_max_loras_and_may_not_be_below_it(tiny_model_dir: pathlib.Path) -> None:
    model = str(tiny_model_dir)
    with pytest.raises(ArgumentError, match="max_loras must be <= max_cpu_loras"):
        EngineArgs(model=model, enable_lora=True, max_loras=4, max_cpu_loras=2)
    args = EngineArgs(model=model, enable_lora=True, max_loras=2, max_cpu_loras=3)
    assert args.to_cli_args()[-4:] == ["--max-loras", "2", "--max-cpu-loras", "3"]
    engine = make_engine(tiny_model_dir, enable_lora=True, max_loras=2)
    assert engine.runner.lora.max_cpu_loras == 2  # type: ignore[union-attr]


def test_least_recently_used_weights_are_dropped_and_read_again_with_the_same_tokens(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapter_dirs, prompt
) -> None:
    roomy = _engine(tiny_model_dir, adapter_dirs, max_cpu_loras=3)  # every adapter stays in memory
    loras = _loras(adapter_dirs)
    expected = {name: _run(roomy, prompt, lora, f"ref-{name}") for name, lora in loras.items()}
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the adapters differ

    engine = _engine(tiny_model_dir, adapter_dirs, max_cpu_loras=2)
    slots = engine.runner.lora  # type: ignore[union-attr]
    assert slots.in_host_memory == [2, 3]  # registered a, b, c in turn: a, the oldest, dropped
    reads: list[str] = []
    read = slots.read

    def counted(lora: LoraRequest):  # type: ignore[no-untyped-def]
        reads.append(lora.name)
        return read(lora)

    slots.read = counted  # type: ignore[method-assign]
    assert _run(engine, prompt, loras["b"], "b1") == expected["b"]  # in memory: no read
    assert reads == [] and slots.in_host_memory == [3, 2]  # b used last: c is now the oldest
    assert _run(engine, prompt, loras["a"], "a1") == expected["a"]  # read again, c dropped
    assert reads == ["a"] and slots.in_host_memory == [2, 1]
    assert _run(engine, prompt, loras["c"], "c1") == expected["c"]
    assert reads == ["a", "c"] and slots.in_host_memory == [1, 3]
    # "c" took the one slot; "a" is loaded into it again from host memory, not from its files.
    assert _run(engine, prompt, loras["a"], "a2") == expected["a"]
    assert reads == ["a", "c"] and slots.in_host_memory == [3, 1]


def test_an_adapter_dropped_from_memory_whose_files_are_gone_is_refused(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapter_dirs, prompt, tmp_path
) -> None:
    dirs = {name: shutil.copytree(path, tmp_path / name) for name, path in adapter_dirs.items()}
    engine = _engine(tiny_model_dir, dirs, max_cpu_loras=2)
    loras = _loras(dirs)
    shutil.rmtree(dirs["a"])  # "a" was dropped at start (the oldest of three)
    with pytest.raises(
        InvalidRequestError, match=r"The adapter 'a' cannot be served: .*not a directory"
    ) as e:
        engine.add_request("gone", prompt, GREEDY, lora=loras["a"])
    assert e.value.param == "model"
    assert "gone" not in engine.requests
    assert len(_run(engine, prompt, loras["b"], "b1")) == GREEDY.max_tokens  # the engine serves on


def test_a_request_whose_adapter_is_dropped_again_and_gone_before_it_runs_is_aborted_alone(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapter_dirs, prompt, tmp_path
) -> None:
    """Admitted while its adapter was in memory; adapters of later requests push it out, and its
    files go: the step aborts that request (logged) and runs the others."""
    dirs = {name: shutil.copytree(path, tmp_path / name) for name, path in adapter_dirs.items()}
    engine = _engine(tiny_model_dir, dirs, max_cpu_loras=1)
    loras = _loras(dirs)
    engine.add_request("b1", prompt, GREEDY, lora=loras["b"])  # "b" runs first, in the one slot
    engine.add_request("a1", prompt, GREEDY, lora=loras["a"])  # "a" read again; it waits for the slot
    engine.add_request("c1", prompt, GREEDY, lora=loras["c"])  # "c" read: "a" dropped again
    engine.add_request("base", prompt, GREEDY)
    shutil.rmtree(dirs["a"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["a1"].finish_reason == "abort" and finished["a1"].token_ids == []
    assert all(len(finished[r].token_ids) == GREEDY.max_tokens for r in ("b1", "c1", "base"))
