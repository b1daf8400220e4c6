"""Tensor parallelism on the CPU with gloo: two ranks (this process and one spawned worker, one
thread each) give the same greedy tokens as one rank and as transformers, for every architecture,
under preemption and with prefix-cache hits; and the shard arithmetic on its own."""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping

import pytest
from corral_engine.errors import EngineDeadError, ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.config import load_model_config
from corral_engine.model.parallel import ShardPlan, check_shardable
from corral_engine.model.tp_workers import ParallelRunner
from corral_engine.sampling_params import SamplingParams

from tests.engine.helpers import (
    ODD_MODEL_OVERRIDES,
    make_engine,
    random_prompts,
    run_checked,
    transformers_greedy,
)

# phi3: its checkpoint's fused qkv_proj and gate_up_proj tensors cut per part per rank; gemma3: its
# replicated (1 + w) norms and per-layer rotary and windows on each rank; granite: its multipliers
# after the all-reduces; gemma2: soft-capped scores per head, and logits capped after the gather.
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "granite", "gemma2"]
# Each expert's intermediate rows split like the MLP's, the router whole on every rank.
MOE_ARCHS = ["mixtral", "qwen3-moe"]
MAX_NEW = 12
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _plan(model_dir: pathlib.Path, rank: int, size: int) -> ShardPlan:
    return ShardPlan.build(load_model_config(model_dir), rank, size)


def test_shards_of_a_gqa_model(tiny_model_dir: pathlib.Path) -> None:
    # tiny: 4 heads of 16, 2 KV heads, intermediate 128, vocabulary 1024
    plans = [_plan(tiny_model_dir, r, 2) for r in range(2)]
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start) for p in plans] == [(2, 1, 0), (2, 1, 1)]
    assert plans[1].checkpoint_slice("model.layers.0.self_attn.q_proj.weight") == (0, 32, 32)
    assert plans[1].checkpoint_slice("model.layers.0.self_attn.k_proj.bias") == (0, 16, 16)
    assert plans[1].checkpoint_slice("model.layers.0.self_attn.o_proj.weight") == (1, 32, 32)
    assert plans[1].checkpoint_slice("model.layers.0.mlp.down_proj.weight") == (1, 64, 64)
    assert plans[1].checkpoint_slice("model.layers.0.mlp.up_proj.weight") == (0, 64, 64)
    assert plans[1].checkpoint_slice("lm_head.weight") == (0, 512, 512)
    assert plans[1].checkpoint_slice("model.layers.0.input_layernorm.weight") is None
    # A row-parallel bias is added once, by rank 0.
    assert plans[0].checkpoint_slice("model.layers.0.mlp.down_proj.bias") is None
    assert plans[1].checkpoint_slice("model.layers.0.mlp.down_proj.bias") is False


def test_shards_of_fused_checkpoint_tensors(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    """Phi-3 stores q|k|v (64 + 32 + 32 rows in tiny) and gate|up (128 + 128) stacked: each rank
    reads its rows of every part, from where that part starts."""
    plans = [_plan(tiny_model_dirs["phi3"], r, 2) for r in range(2)]
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    assert plans[0].checkpoint_slice(qkv) == [(0, 0, 32), (0, 64, 16), (0, 96, 16)]
    assert plans[1].checkpoint_slice(qkv) == [(0, 32, 32), (0, 80, 16), (0, 112, 16)]
    assert plans[1].checkpoint_slice(gate_up) == [(0, 64, 64), (0, 192, 64)]


def test_a_replicated_kv_head_of_a_fused_tensor_is_read_by_every_rank(
    tiny_model_dirs: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    config = json.loads((tiny_model_dirs["phi3"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    cuts = [
        _plan(tmp_path, r, 2).checkpoint_slice("model.layers.0.self_attn.qkv_proj.weight") for r in range(2)
    ]
    assert cuts == [[(0, 0, 32), (0, 64, 16), (0, 80, 16)], [(0, 32, 32), (0, 64, 16), (0, 80, 16)]]


def test_shards_of_the_experts(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    # tiny qwen3-moe: 4 experts of intermediate size 64; mixtral's take the MLP's 128
    plans = [_plan(tiny_model_dirs["qwen3-moe"], r, 2) for r in range(2)]
    assert [p.expert_intermediate_size for p in plans] == [32, 32]
    layer = "model.layers.1.mlp"
    assert plans[1].checkpoint_slice(f"{layer}.experts.3.gate_proj.weight") == (0, 32, 32)
    assert plans[1].checkpoint_slice(f"{layer}.experts.3.down_proj.weight") == (1, 32, 32)
    assert plans[1].checkpoint_slice(f"{layer}.gate.weight") is None  # the router: replicated
    # transformers v5's fused layout: [E, 2I, H] (gate rows, then up rows) and [E, H, I]
    assert plans[1].checkpoint_slice(f"{layer}.experts.gate_up_proj") == [(1, 32, 32), (1, 96, 32)]
    assert plans[1].checkpoint_slice(f"{layer}.experts.down_proj") == (2, 32, 32)
    mixtral = _plan(tiny_model_dirs["mixtral"], 0, 2)
    layer = "model.layers.0.block_sparse_moe"
    assert mixtral.checkpoint_slice(f"{layer}.experts.0.w3.weight") == (0, 0, 64)
    assert mixtral.checkpoint_slice(f"{layer}.experts.0.w2.weight") == (1, 0, 64)
    assert mixtral.checkpoint_slice(f"{layer}.gate.weight") is None


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_model_dir: pathlib.Path) -> None:
    plans = [_plan(tiny_model_dir, r, 4) for r in range(4)]  # 2 KV heads over 4 ranks
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start) for p in plans] == [
        (1, 1, 0),
        (1, 1, 0),
        (1, 1, 1),
        (1, 1, 1),
    ]


def test_a_vocabulary_that_does_not_divide_pads_the_last_rank(tmp_path: pathlib.Path) -> None:
    from corral_engine.demo_model import write_demo_model

    model_dir = write_demo_model(tmp_path / "m", preset="tiny", config_overrides={"vocab_size": 1023})
    last = _plan(model_dir, 1, 2)
    assert (last.vocab_size, last.vocab_start) == (512, 512)
    assert last.checkpoint_slice("model.embed_tokens.weight") == (0, 512, 511)


@pytest.mark.parametrize(("size", "what"), [(3, "attention heads"), (8, "attention heads")])
def test_sizes_that_do_not_divide_the_model_are_refused(
    tiny_model_dir: pathlib.Path, size: int, what: str
) -> None:
    with pytest.raises(ModelLoadError, match=f"--tensor-parallel-size {size} must divide.*{what}"):
        check_shardable(load_model_config(tiny_model_dir), size)


def _generate(engine: LLMEngine, prompts: list[list[int]], prefix: str) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, PARAMS)
    final = run_checked(engine)
    return [final[f"{prefix}{i}"] for i in range(len(prompts))]


def _workload(model_dir: pathlib.Path, **engine_kwargs: object) -> tuple[list[list[int]], ...]:
    """16 prompts in a cache small enough to preempt, then prompts sharing a cached prefix."""
    engine = make_engine(model_dir, num_kv_blocks=12, block_size=8, **engine_kwargs)
    try:
        batch = _generate(engine, random_prompts(16, 500, seed=11), "b")
        assert engine.stats().num_preemptions_total > 0
        shared = random_prompts(1, 500, seed=7, min_len=40, max_len=40)[0]
        _generate(engine, [shared], "warm")
        hits_before = engine.stats().num_prefix_cache_hits_total
        tails = random_prompts(4, 500, seed=8, min_len=1, max_len=20)
        prefixed = _generate(engine, [shared + t for t in tails], "p")
        assert engine.stats().num_prefix_cache_hits_total - hits_before >= 4 * 32
        return batch, prefixed
    finally:
        engine.runner.close()


def _references(model_dir: pathlib.Path) -> tuple[list[list[int]], ...]:
    shared = random_prompts(1, 500, seed=7, min_len=40, max_len=40)[0]
    tails = random_prompts(4, 500, seed=8, min_len=1, max_len=20)
    return (
        transformers_greedy(model_dir, random_prompts(16, 500, seed=11), MAX_NEW),
        transformers_greedy(model_dir, [shared + t for t in tails], MAX_NEW),
    )


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """The tiny Llama with ODD_MODEL_OVERRIDES: one KV head for two ranks, biases, tied embeddings
    and a vocabulary two ranks split unevenly."""
    from corral_engine.demo_model import write_demo_model

    yield write_demo_model(
        tmp_path_factory.mktemp("tp") / "odd",
        preset="tiny",
        arch="llama",
        config_overrides=ODD_MODEL_OVERRIDES,
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", [*ARCHS, "odd", *MOE_ARCHS])
def test_two_ranks_match_one_rank_and_transformers(
    arch: str, tiny_model_dirs: Mapping[str, pathlib.Path], odd_model_dir: pathlib.Path
) -> None:
    model_dir = odd_model_dir if arch == "odd" else tiny_model_dirs[arch]
    expected = _references(model_dir)
    if arch in ("odd", *MOE_ARCHS):  # the dense demos' one-rank equality: test_engine_matches_transformers
        assert _workload(model_dir) == expected
    assert _workload(model_dir, tensor_parallel_size=2) == expected


def test_experts_that_do_not_divide_are_refused(tmp_path: pathlib.Path) -> None:
    from corral_engine.demo_model import write_demo_model

    overrides = {"moe_intermediate_size": 63}
    model_dir = write_demo_model(tmp_path / "m", preset="tiny", arch="qwen3-moe", config_overrides=overrides)
    message = "--tensor-parallel-size 2 must divide the experts' intermediate size 63"
    with pytest.raises(ModelLoadError, match=message):
        make_engine(model_dir, tensor_parallel_size=2)


@pytest.mark.parametrize("mlp_only_layers", [[], [0]], ids=["all-sparse", "one-dense"])
def test_the_dense_intermediate_size_counts_only_where_a_layer_is_dense(
    tiny_model_dirs: Mapping[str, pathlib.Path], tmp_path: pathlib.Path, mlp_only_layers: list[int]
) -> None:
    """Qwen3-MoE's `intermediate_size` is its dense MLP's: unused when every layer has experts."""
    config = json.loads((tiny_model_dirs["qwen3-moe"] / "config.json").read_text())
    config.update(intermediate_size=127, mlp_only_layers=mlp_only_layers)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if not mlp_only_layers:
        check_shardable(load_model_config(tmp_path), 2)
        return
    with pytest.raises(ModelLoadError, match=r"must divide the MLP's intermediate size 127$"):
        check_shardable(load_model_config(tmp_path), 2)


def test_a_size_the_model_cannot_split_fails_before_any_worker_starts(tiny_model_dir: pathlib.Path) -> None:
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 3 must divide the 4 attention heads"):
        make_engine(tiny_model_dir, tensor_parallel_size=3)


@pytest.mark.slow
def test_a_dead_rank_fails_the_next_step_naming_it(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2)
    runner = engine.runner
    assert isinstance(runner, ParallelRunner)
    failures: list[str] = []
    runner.on_failure = failures.append
    try:
        (worker,) = runner.workers
        worker.kill()
        worker.join(10)
        engine.add_request("r", [1, 2, 3], PARAMS)
        with pytest.raises(EngineDeadError, match=f"tensor-parallel rank 1 \\(pid {worker.pid}\\) exited"):
            engine.step()
        deadline = time.monotonic() + 5  # the watchdog calls back on its own thread
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "rank 1" in failures[0]
    finally:
        runner.close()


def _kill_first_worker(killed: list[int]) -> None:
    """Kill the first tensor-parallel worker as soon as it exists (it is still importing torch:
    it dies before the ranks meet)."""
    while True:
        workers = [p for p in multiprocessing.active_children() if p.name.startswith("corral-tp-rank")]
        if workers:
            killed.append(workers[0].pid or 0)
            workers[0].kill()
            return
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(120, method="thread")  # a hang guard: rank 0 waited out the rendezvous in C
def test_a_rank_that_dies_during_start_up_fails_it_naming_the_rank(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the rendezvous directory goes
    killed: list[int] = []
    killer = threading.Thread(target=_kill_first_worker, args=(killed,), daemon=True)
    killer.start()
    with pytest.raises(ModelLoadError, match=r"tensor-parallel rank 1 \(pid [0-9]+\) exited with code -9"):
        make_engine(tiny_model_dir, tensor_parallel_size=2)
    assert killed
    assert not list(tmp_path.glob("corral-tp-*"))


@pytest.mark.slow
def test_workers_remove_the_rendezvous_directory_when_rank_0_is_gone(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed engine runs no clean-up; its workers, seeing rank 0's pipe close, remove it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2)
    runner = engine.runner
    assert isinstance(runner, ParallelRunner)
    (store_dir,) = tmp_path.glob("corral-tp-*")
    (pipe,) = runner._pipes
    runner._closing = True  # as if rank 0 died: the pipe closes with no stop message
    pipe.close()
    (worker,) = runner.workers
    worker.join(60)
    assert worker.exitcode == 0
    assert not store_dir.exists()
    runner._pipes = []
    runner.close()


@pytest.mark.slow
def test_prompt_logprobs_under_two_ranks(tiny_model_dir: pathlib.Path) -> None:
    """prompt_logprobs add logits rows after the sampled ones; every rank must agree on them."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prompts = random_prompts(3, 500, seed=5, min_len=20, max_len=40)
    outputs = []
    for size in (1, 2):
        engine = make_engine(tiny_model_dir, tensor_parallel_size=size, max_num_batched_tokens=16)
        try:
            outputs.append(engine.generate(prompts, params))
        finally:
            engine.runner.close()
    for one, two in zip(*outputs, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        assert one.prompt_logprobs is not None and two.prompt_logprobs is not None
        assert len(one.prompt_logprobs) == len(two.prompt_logprobs) > 1
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
