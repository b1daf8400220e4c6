"""What each experiment runs: engine settings x load settings, full and `--quick` sizes (pure).

(1) rate-x-seqs: output throughput over request rate x max_num_seqs at 128 in / 128 out.
(2) preemptions: preemptions (and throughput) against max_num_seqs under a tight KV budget.
(3) kv-budget: throughput (and preemptions) against the KV budget at a fixed max_num_seqs.
(4) policy: `preempt` against `reserve` on ShareGPT-like lengths the engine does not know in advance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from corral_cli.bench.workload import LengthSpec

INF = math.inf
EXPERIMENTS = ("rate-x-seqs", "preemptions", "kv-budget", "policy")
FIXED_128 = LengthSpec(128, 128)
# ShareGPT-like (issue 8's W2): log-normal medians 150 in / 120 out, clipped 8..1024 and 8..512.
SHAREGPT_LIKE = LengthSpec(
    150, 120, dist="lognormal", sigma=1.0, min_len=8, max_input_len=1024, max_output_len=512
)
SHAREGPT_LIKE_QUICK = LengthSpec(
    40, 30, dist="lognormal", sigma=1.0, min_len=8, max_input_len=256, max_output_len=128
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The `corral engine` settings an experiment varies (everything else is the engine default)."""

    max_num_seqs: int
    num_kv_blocks: int | None = None
    kv_policy: str = "preempt"

    def flags(self) -> dict[str, Any]:
        """Keyword flags for `e2e.procs.start_engine` (python names)."""
        return {
            "max_num_seqs": self.max_num_seqs,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_policy": self.kv_policy,
        }


@dataclass(frozen=True, slots=True)
class LoadConfig:
    request_rate: float  # requests/s; inf sends everything at once
    num_prompts: int
    lengths: LengthSpec
    # None: max_tokens is each request's sampled length (the engine knows it); N: max_tokens = N
    # and the client ends the stream after the sampled length (`corral bench --max-tokens-cap`).
    max_tokens_cap: int | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RunSpec:
    engine: EngineConfig
    load: LoadConfig
    variant: str = ""  # a row label where one engine setting runs several ways (experiment 4)


@dataclass(frozen=True, slots=True)
class Experiment:
    name: str
    title: str
    runs: tuple[RunSpec, ...]


def grid(
    max_num_seqs: tuple[int, ...], rates: tuple[float, ...], num_prompts: int, lengths: LengthSpec
) -> tuple[RunSpec, ...]:
    """Every (max_num_seqs, rate) pair, grouped by max_num_seqs so each engine runs all its rates."""
    return tuple(
        RunSpec(EngineConfig(seqs), LoadConfig(rate, num_prompts, lengths))
        for seqs in max_num_seqs
        for rate in rates
    )


def rate_x_seqs(quick: bool = False) -> Experiment:
    if quick:
        runs = grid((8, 32), (20.0, INF), 24, FIXED_128)
    else:
        runs = grid((8, 16, 32, 64, 128), (10.0, 20.0, 40.0, INF), 160, FIXED_128)
    return Experiment(
        "rate-x-seqs", "Output throughput over request rate x max_num_seqs (128 in / 128 out)", runs
    )


def preemptions(quick: bool = False) -> Experiment:
    """A KV budget that holds only some full sequences: past it, a larger max_num_seqs preempts."""
    seqs_values: tuple[int, ...]
    if quick:
        blocks, seqs_values, load = 48, (2, 8), LoadConfig(INF, 16, LengthSpec(64, 64))
    else:
        # 512 blocks x 16 = 8192 tokens: 32 sequences of 128 + 128 fit.
        blocks, seqs_values, load = 512, (8, 16, 32, 48, 64, 96, 128), LoadConfig(INF, 256, FIXED_128)
    runs = tuple(RunSpec(EngineConfig(seqs, blocks), load) for seqs in seqs_values)
    return Experiment("preemptions", f"Preemptions against max_num_seqs ({blocks} KV blocks)", runs)


def kv_budget(quick: bool = False) -> Experiment:
    blocks_values: tuple[int, ...]
    if quick:
        seqs, blocks_values, load = 16, (48, 256), LoadConfig(INF, 16, LengthSpec(64, 64))
    else:
        seqs, blocks_values, load = 128, (128, 256, 512, 1024, 2048, 4096), LoadConfig(INF, 256, FIXED_128)
    runs = tuple(RunSpec(EngineConfig(seqs, blocks), load) for blocks in blocks_values)
    return Experiment("kv-budget", f"Throughput against the KV budget (max_num_seqs {seqs})", runs)


PREEMPT = "preempt"
RESERVE = "reserve"
RESERVE_KNOWN = "reserve, lengths known"


def policy(quick: bool = False) -> Experiment:
    """Per KV budget and rate: `preempt` and `reserve` with max_tokens = the cap (lengths unknown),
    and `reserve` told each exact length (max_tokens = sampled length) as the reference it cannot reach."""
    budgets: tuple[int, ...]
    rates: tuple[float, ...]
    if quick:
        seqs, budgets, rates, num_prompts, lengths = 32, (64,), (INF,), 24, SHAREGPT_LIKE_QUICK
    else:
        seqs, budgets, rates, num_prompts, lengths = 128, (512, 1024, 2048), (INF, 25.0), 200, SHAREGPT_LIKE
    cap = lengths.max_output_len
    runs = []
    for blocks in budgets:
        for kv_policy, variants in (
            (PREEMPT, ((PREEMPT, cap),)),
            (RESERVE, ((RESERVE, cap), (RESERVE_KNOWN, None))),
        ):
            engine = EngineConfig(seqs, blocks, kv_policy)
            for rate in rates:
                for variant, variant_cap in variants:
                    runs.append(RunSpec(engine, LoadConfig(rate, num_prompts, lengths, variant_cap), variant))
    title = f"preempt vs reserve, ShareGPT-like lengths unknown to the engine (max_num_seqs {seqs})"
    return Experiment("policy", title, tuple(runs))


BUILDERS = {"rate-x-seqs": rate_x_seqs, "preemptions": preemptions, "kv-budget": kv_budget, "policy": policy}


def build(name: str, quick: bool = False) -> Experiment:
    if name not in BUILDERS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return BUILDERS[name](quick)


def group_by_engine(runs: tuple[RunSpec, ...]) -> list[tuple[EngineConfig, list[RunSpec]]]:
    """Consecutive runs that share engine settings, so each engine process starts once."""
    groups: list[tuple[EngineConfig, list[RunSpec]]] = []
    for run in runs:
        if groups and groups[-1][0] == run.engine:
            groups[-1][1].append(run)
        else:
            groups.append((run.engine, [run]))
    return groups


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """K and V bytes one token holds across all layers, from a Hugging Face config.json."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    itemsize = 4 if dtype == "float32" else 2
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * itemsize
