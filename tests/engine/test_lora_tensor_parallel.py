"""LoRA adapters under tensor parallelism (CPU, gloo, two ranks): each rank holds its shard of every
adapter, and a batch mixing two adapters and the base model gives one rank's greedy tokens and
transformers + peft's; adapters added and removed at run time reach every rank; an adapter any rank
refuses is held by none."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator, Mapping

import pytest
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.errors import EngineDeadError
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.model.tp_workers import ParallelRunner
from corral_engine.sampling_params import SamplingParams

from tests.engine.helpers import ODD_MODEL_OVERRIDES, make_engine, peft_greedy, random_prompts, run_checked

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
NAMES = ["all", None, "some", "all", "some", None]  # each prompt's adapter (None: the base model)

pytestmark = pytest.mark.slow  # every test starts a worker process


@pytest.fixture(scope="module")
def model_dirs(
    tiny_model_dir: pathlib.Path,
    tiny_model_dirs: Mapping[str, pathlib.Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Mapping[str, pathlib.Path]:
    from corral_engine.demo_model import write_demo_model

    odd = write_demo_model(
        tmp_path_factory.mktemp("lora-tp") / "odd",
        preset="tiny",
        arch="llama",
        config_overrides=ODD_MODEL_OVERRIDES,
    )
    # Phi-3: adapters of its fused qkv_proj / gate_up_proj, B's rows cut per part per rank; with
    # one KV head, each rank's k and v rows are the same (replicated) ones.
    phi3_kv1 = write_demo_model(
        tmp_path_factory.mktemp("lora-tp") / "phi3-kv1",
        preset="tiny",
        arch="phi3",
        config_overrides={"num_key_value_heads": 1},
    )
    return {"llama": tiny_model_dir, "odd": odd, "phi3": tiny_model_dirs["phi3"], "phi3-kv1": phi3_kv1}


def _adapters(model_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Adapter "all" targets every projection (rank 8), "some" a column- and a row-parallel one
    (rank 4; Phi-3's column-parallel one is its fused qkv_proj)."""
    root = model_dir.parent / f"{model_dir.name}-adapters"
    is_phi3 = json.loads((model_dir / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    some = ("qkv_proj", "o_proj") if is_phi3 else ("v_proj", "o_proj")
    return {
        "all": write_demo_adapter(model_dir, root / "all", rank=8, seed=1),
        "some": write_demo_adapter(model_dir, root / "some", rank=4, alpha=8, seed=2, targets=some),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(NAMES), 500, seed=5, max_len=40)


def _run(engine, prompts, names, loras, prefix="r"):  # type: ignore[no-untyped-def]
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"{prefix}{i}", prompt, GREEDY, lora=loras[name])
    final = run_checked(engine)
    return [final[f"{prefix}{i}"] for i in range(len(prompts))]


def _loras(adapters: Mapping[str, pathlib.Path]) -> dict[str | None, LoraRequest | None]:
    """The requests' adapters: ids 1..N in --lora-modules order, as the engine registers them."""
    out: dict[str | None, LoraRequest | None] = {None: None}
    for i, (name, path) in enumerate(adapters.items(), start=1):
        out[name] = LoraRequest(name, i, str(path))
    return out


def _generate(model_dir: pathlib.Path, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    adapters = _adapters(model_dir)
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    # max_loras 1: the adapters take turns in the one slot (loaded again and again on every rank).
    engine = make_engine(model_dir, enable_lora=True, lora_modules=modules, max_loras=1, **kwargs)
    try:
        return _run(engine, prompts, NAMES, _loras(adapters))
    finally:
        engine.runner.close()


@pytest.mark.parametrize("arch", ["llama", "odd", "phi3", "phi3-kv1"])
def test_two_ranks_match_one_rank_and_peft(
    arch: str, model_dirs: Mapping[str, pathlib.Path], prompts: list[list[int]]
) -> None:
    model_dir = model_dirs[arch]
    adapters: dict[str | None, pathlib.Path | None] = {None: None, **_adapters(model_dir)}
    refs = {name: peft_greedy(model_dir, path, prompts, MAX_NEW) for name, path in adapters.items()}
    expected = [refs[name][i] for i, name in enumerate(NAMES)]
    assert refs["all"] != refs[None] and refs["some"] != refs[None]  # the adapters change tokens
    assert _generate(model_dir, prompts) == expected
    assert _generate(model_dir, prompts, tensor_parallel_size=2) == expected


@pytest.fixture
def tp_engine(tiny_model_dir: pathlib.Path) -> Iterator:  # type: ignore[type-arg]
    engine = make_engine(tiny_model_dir, enable_lora=True, tensor_parallel_size=2, max_loras=2)
    try:
        yield engine
    finally:
        engine.runner.close()


def _one_rank(model_dir: pathlib.Path, prompts, names, loras):  # type: ignore[no-untyped-def]
    engine = make_engine(model_dir, enable_lora=True, max_loras=2)
    for lora in loras.values():
        if lora is not None:
            engine.add_lora(lora)
    try:
        return _run(engine, prompts, names, loras)
    finally:
        engine.runner.close()


def test_adapters_added_and_removed_at_run_time_reach_every_rank(
    tp_engine, tiny_model_dir: pathlib.Path, prompts: list[list[int]]
) -> None:  # type: ignore[no-untyped-def]
    adapters = _adapters(tiny_model_dir)
    third = write_demo_adapter(tiny_model_dir, tiny_model_dir.parent / "third", rank=2, seed=3)
    loras = {None: None, **{n: LoraRequest(n, i, str(p)) for i, (n, p) in enumerate(adapters.items(), 5)}}
    loras["third"] = LoraRequest("third", 9, str(third))
    names = ["all", "third", None, "some", "third", "all"]  # three adapters, two slots: evictions
    expected = _one_rank(tiny_model_dir, prompts, names, loras)
    for lora in loras.values():
        if lora is not None:
            tp_engine.add_lora(lora)
    assert _run(tp_engine, prompts, names, loras) == expected
    runner = tp_engine.runner
    assert isinstance(runner, ParallelRunner)
    tp_engine.remove_lora(9)
    _run(tp_engine, prompts[:1], [None], loras, prefix="after")  # a step drops it on every rank
    assert 9 not in runner.local.lora.adapters  # type: ignore[union-attr]
    # The worker dropped it too: it would refuse the same id as "already loaded".
    tp_engine.add_lora(loras["third"])
    assert _run(tp_engine, prompts, names, loras, prefix="again") == expected


def test_an_adapter_any_rank_refuses_is_held_by_none(
    tp_engine, tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, prompts: list[list[int]], monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    runner = tp_engine.runner
    assert isinstance(runner, ParallelRunner)
    good = _adapters(tiny_model_dir)["all"]
    lora = LoraRequest("all", 3, str(good))
    expected = _one_rank(tiny_model_dir, prompts[:2], ["all", None], {None: None, "all": lora})
    # Every rank refuses (an adapter of a wider model): the message is the one a single rank gives.
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "wider").mkdir()
    (tmp_path / "wider" / "config.json").write_text(json.dumps(config | {"intermediate_size": 256}))
    wide = write_demo_adapter(tmp_path / "wider", tmp_path / "wide", rank=4)
    with pytest.raises(AdapterError, match=r"adapter 'wide': layer \d+ \w+ has lora_A .* base model needs"):
        tp_engine.add_lora(LoraRequest("wide", 1, str(wide)))
    # Rank 0 refuses, the worker takes it: the worker drops it again.
    add = runner.local.add_lora

    def refuse(lora: LoraRequest) -> None:
        raise AdapterError("rank 0 says no")

    with monkeypatch.context() as m:
        m.setattr(runner.local, "add_lora", refuse)
        with pytest.raises(AdapterError, match="rank 0 says no"):
            tp_engine.add_lora(lora)
    # The worker refuses (its path has no adapter), rank 0 takes it: rank 0 drops it, the worker's
    # error is the one raised.
    broken = dataclasses.replace(lora, path=str(tmp_path / "nowhere"))
    with monkeypatch.context() as m:
        m.setattr(runner.local, "add_lora", lambda _: add(lora))
        with pytest.raises(AdapterError, match=r"nowhere is not a directory"):
            tp_engine.add_lora(broken)
    assert 3 not in runner.local.lora.adapters  # type: ignore[union-attr]
    # No rank kept it: the same id is taken again everywhere, and runs as on one rank.
    tp_engine.add_lora(lora)
    assert _run(tp_engine, prompts[:2], ["all", None], {None: None, "all": lora}) == expected


def test_a_rank_dead_before_an_adapter_is_added_fails_it_naming_the_rank(
    tp_engine, tiny_model_dir: pathlib.Path
) -> None:  # type: ignore[no-untyped-def]
    runner = tp_engine.runner
    assert isinstance(runner, ParallelRunner)
    runner.on_failure = lambda message: None  # the test's process stays
    (worker,) = runner.workers
    worker.kill()
    worker.join(10)
    with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 \(pid \d+\) exited"):
        tp_engine.add_lora(LoraRequest("all", 1, str(_adapters(tiny_model_dir)["all"])))
