"""Multi-LoRA serving: greedy tokens equal transformers + peft in float32 (one adapter, a batch
mixing adapters and the base model, chunked prefill, preemption), the prefix cache kept apart per
adapter, max_loras honoured, and bad adapters refused with errors that say what is wrong."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import pytest
from corral_engine.args import ArgumentError, EngineArgs
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.errors import ModelLoadError
from corral_engine.lora import AdapterError, LoraRequest, read_adapter_config
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

from tests.engine.helpers import make_engine, peft_greedy, random_prompts, run_checked

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(
    tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_demo_adapter(tiny_model_dir, root / "all", rank=8, seed=1),
        "some": write_demo_adapter(
            tiny_model_dir, root / "some", rank=4, alpha=8, seed=2, targets=("q_proj", "v_proj", "down_proj")
        ),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 500, seed=7)


@pytest.fixture(scope="module")
def expected(
    tiny_model_dir: pathlib.Path, adapters: dict[str, pathlib.Path], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    refs = {name: peft_greedy(tiny_model_dir, path, prompts, MAX_NEW) for name, path in adapters.items()}
    refs[None] = peft_greedy(tiny_model_dir, None, prompts, MAX_NEW)
    assert refs["all"] != refs[None] and refs["some"] != refs[None]  # the adapters change outputs
    return refs


def _lora_engine(model_dir: pathlib.Path, adapters: Mapping[str, pathlib.Path], **kwargs: object):  # type: ignore[no-untyped-def]
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    return make_engine(model_dir, enable_lora=True, lora_modules=modules, **kwargs)


def _loras(adapters: Mapping[str, pathlib.Path]) -> dict[str | None, LoraRequest | None]:
    """The requests' adapters: ids 1..N in --lora-modules order, as the engine registers them."""
    out: dict[str | None, LoraRequest | None] = {None: None}
    for i, (name, path) in enumerate(adapters.items(), start=1):
        out[name] = LoraRequest(name, i, str(path))
    return out


def _run_mixed(engine, prompts, names, loras):  # type: ignore[no-untyped-def]
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora=loras[name])
    final = run_checked(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]


def test_one_adapter_alone_matches_peft(tiny_model_dir, adapters, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    engine = _lora_engine(tiny_model_dir, {"all": adapters["all"]})
    loras = _loras({"all": adapters["all"]})
    for i in range(2):
        assert _run_mixed(engine, [prompts[i]], ["all"], loras) == [expected["all"][i]]


@pytest.mark.parametrize("max_num_batched_tokens", [1024, 7], ids=["one-step-prefill", "chunked-prefill"])
def test_batch_mixing_two_adapters_and_the_base_matches_peft(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapters, prompts, expected, max_num_batched_tokens
) -> None:
    engine = _lora_engine(tiny_model_dir, adapters, max_num_batched_tokens=max_num_batched_tokens)
    names = ["all", None, "some", "some", None, "all"]
    got = _run_mixed(engine, prompts, names, _loras(adapters))
    assert got == [expected[name][i] for i, name in enumerate(names)]


def test_async_scheduling_and_output_overlap_keep_each_rows_adapter(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapters, prompts, expected
) -> None:
    settings = EngineSettings(async_scheduling="1", overlap_output="1")
    engine = _lora_engine(tiny_model_dir, adapters, settings=settings, max_loras=1)
    names = ["some", None, "all", "some", "all", None]
    assert _run_mixed(engine, prompts, names, _loras(adapters)) == [
        expected[n][i] for i, n in enumerate(names)
    ]


def test_preempted_adapter_requests_resume_with_their_adapter(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapters, prompts, expected
) -> None:
    # A cache too small for all six at once: the newest are preempted and recomputed.
    longest = max(len(p) for p in prompts) + MAX_NEW
    engine = _lora_engine(tiny_model_dir, adapters, num_kv_blocks=-(-longest // 16) * 3, block_size=16)
    names = ["some", "all", None, "all", "some", None]
    got = _run_mixed(engine, prompts, names, _loras(adapters))
    assert engine.scheduler.num_preemptions > 0
    assert got == [expected[name][i] for i, name in enumerate(names)]


def test_an_adapter_request_never_hits_the_base_models_prefix(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapters, prompts, expected
) -> None:
    engine = _lora_engine(tiny_model_dir, {"all": adapters["all"]})
    loras = _loras({"all": adapters["all"]})
    prompt = prompts[1]  # 63 tokens: three full blocks of 16
    cached = {}
    for request_id, name in [("base", None), ("lora", "all"), ("lora-again", "all"), ("base-again", None)]:
        request = engine.add_request(request_id, prompt, GREEDY, lora=loras[name])
        final = run_checked(engine)
        assert final[request_id] == expected[name][1]
        cached[request_id] = request.metrics.num_cached_tokens
    assert cached["lora"] == 0  # the base model's blocks of the same tokens hold other KV
    assert cached["lora-again"] > 0 and cached["base-again"] > 0  # each finds its own


def test_max_loras_one_runs_two_adapters_in_turn(tiny_model_dir, adapters, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    engine = _lora_engine(tiny_model_dir, adapters, max_loras=1)
    loras = _loras(adapters)
    names = ["all", "some", "all", None, "some", "all"]
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora=loras[name])
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        running = {s.request.lora.name for s in engine.scheduler.running if s.request.lora is not None}
        assert len(running) <= 1
    assert [final[f"r{i}"] for i in range(len(names))] == [expected[n][i] for i, n in enumerate(names)]


def test_max_loras_one_runs_base_requests_beside_an_adapter_and_does_not_starve_the_other(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapters, prompts, expected
) -> None:
    """Adapter "all" runs, "some" waits for the one slot: a base request passes and finishes then;
    "all"'s requests, arriving every step, pass "some"'s only for a while, then "some" runs."""
    engine = _lora_engine(tiny_model_dir, adapters, max_loras=1)
    loras = _loras(adapters)
    asked = {"a0": ("all", 0), "b": ("some", 1), "base": (None, 2)}
    for request_id, (name, i) in asked.items():
        engine.add_request(request_id, prompts[i], GREEDY, lora=loras[name])
    final: dict[str, list[int]] = {}
    adapters_when_base_finished = None  # (running, waiting) adapters' names
    for step in range(1, 500):
        if not any(s.request.request_id == "b" for s in engine.scheduler.waiting):
            break  # "some" got the slot
        asked[f"a{step}"] = ("all", step % len(prompts))  # "all" keeps getting work
        engine.add_request(f"a{step}", prompts[step % len(prompts)], GREEDY, lora=loras["all"])
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        if "base" in final and adapters_when_base_finished is None:
            adapters_when_base_finished = engine.scheduler.lora_names()
    else:
        raise AssertionError('"some" never got the slot')
    assert adapters_when_base_finished == ("all", "some")
    final.update(run_checked(engine))
    assert {r: final[r] for r in asked} == {r: expected[name][i] for r, (name, i) in asked.items()}


def test_runtime_added_adapter_and_removal(tiny_model_dir, adapters, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_model_dir, enable_lora=True)
    lora = LoraRequest("late", 7, str(adapters["some"]))
    engine.add_lora(lora)
    assert _run_mixed(engine, [prompts[2]], ["some"], {"some": lora}) == [expected["some"][2]]
    engine.remove_lora(7)
    engine.add_request("after", prompts[0], GREEDY)
    run_checked(engine)
    assert 7 not in engine.runner.lora.adapters  # type: ignore[union-attr]
    engine.add_lora(LoraRequest("again", 9, str(adapters["all"])))
    with pytest.raises(AdapterError, match="already loaded"):
        engine.add_lora(LoraRequest("again", 9, str(adapters["all"])))


def _broken(adapter: pathlib.Path, tmp_path: pathlib.Path, **config: object) -> pathlib.Path:
    out = tmp_path / "broken"
    out.mkdir()
    for f in adapter.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    raw = json.loads((out / "adapter_config.json").read_text()) | config
    (out / "adapter_config.json").write_text(json.dumps(raw))
    return out


def test_bad_adapters_are_refused_at_start_naming_the_problem(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapters, tmp_path
) -> None:
    with pytest.raises(ModelLoadError, match=r"adapter 'big'.*rank 8 is larger than --max-lora-rank 4"):
        _lora_engine(tiny_model_dir, {"big": adapters["all"]}, max_lora_rank=4)
    with pytest.raises(ModelLoadError, match=r"adapter 'gone'.*not a directory"):
        _lora_engine(tiny_model_dir, {"gone": tmp_path / "nowhere"})
    lm_head = _broken(adapters["all"], tmp_path, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ModelLoadError, match=r"adapter 'head'.*target modules lm_head are not supported"):
        _lora_engine(tiny_model_dir, {"head": lm_head})


def test_a_shape_the_base_model_lacks_is_refused(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps(config | {"intermediate_size": 2 * config["intermediate_size"]})
    )
    adapter = write_demo_adapter(other, tmp_path / "wide", rank=4)
    engine = make_engine(tiny_model_dir, enable_lora=True)
    with pytest.raises(AdapterError, match=r"adapter 'wide'.*needs"):
        engine.add_lora(LoraRequest("wide", 1, str(adapter)))
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors is missing"):
        (tmp_path / "no-weights").mkdir()
        (tmp_path / "no-weights" / "adapter_config.json").write_text(
            json.dumps({"r": 4, "target_modules": ["q_proj"]})
        )
        engine.add_lora(LoraRequest("no-weights", 2, str(tmp_path / "no-weights")))


def test_lora_argument_rules(tiny_model_dir, tiny_model_dirs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArgumentError, match="needs enable_lora"):
        EngineArgs(model=str(tiny_model_dir), lora_modules=("a=/x",))
    with pytest.raises(ArgumentError, match="NAME=PATH"):
        EngineArgs(model=str(tiny_model_dir), enable_lora=True, lora_modules=("nameonly",))
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        make_engine(tiny_model_dirs["mixtral"], enable_lora=True)
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):  # refused before a worker starts
        make_engine(tiny_model_dirs["mixtral"], enable_lora=True, tensor_parallel_size=2)
    args = EngineArgs(
        model="/m", enable_lora=True, lora_modules=("a=/x", '{"name": "b", "path": "/y"}'), max_loras=2
    )
    assert args.to_cli_args() == [
        "--model", "/m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
        "--max-loras", "2",
    ]  # fmt: skip


def test_adapter_config_scale(tmp_path: pathlib.Path) -> None:
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 16, "lora_alpha": 32, "target_modules": "q_proj", "use_rslora": True})
    )
    config = read_adapter_config("x", str(tmp_path), 16)
    assert config.target_modules == ("q_proj",) and config.scale == 32 / 4


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_an_adapter_saved_as_a_pickle_matches_peft(  # type: ignore[no-untyped-def]
    tiny_model_dir, adapters, prompts, expected, tmp_path, tensor_parallel_size
) -> None:
    """PEFT's older adapter_model.bin (read with weights_only; each rank cuts its shard of it)."""
    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes((adapters["some"] / "adapter_config.json").read_bytes())
    torch.save(load_file(adapters["some"] / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    engine = _lora_engine(tiny_model_dir, {"some": pickled}, tensor_parallel_size=tensor_parallel_size)
    loras = _loras({"some": pickled})
    assert _run_mixed(engine, prompts[:2], ["some", None], loras) == [expected["some"][0], expected[None][1]]
    engine.runner.close()
