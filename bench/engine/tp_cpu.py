"""Tensor parallelism on the CPU: the same offline workload with --tensor-parallel-size 1 (one
process, every core) and N (N processes sharing the cores), greedy, through LLMEngine.

    python -m bench.engine.tp_cpu --model /tmp/small --tp 2

Prints one line per size: batch-1 decode (ms per token) and a 32-prompt batch (output tokens/s),
each the best of --repeats runs, and whether both sizes produced the same tokens.
"""

from __future__ import annotations

import argparse
import logging
import time

from corral_engine import EngineArgs, SamplingParams
from corral_engine.llm_engine import LLMEngine

from bench.gpu.reference import random_prompts

log = logging.getLogger("tp_cpu")


Result = tuple[float, float, list[list[int]]]


def run(model: str, tp: int, dtype: str, max_tokens: int, repeats: int) -> Result:
    # No prefix caching: every repeat computes its prompts again.
    args = EngineArgs(model=model, dtype=dtype, tensor_parallel_size=tp, enable_prefix_caching=False)  # type: ignore[arg-type]
    engine = LLMEngine(args)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(random_prompts(2, 1000, seed=1), params)  # warm-up
        one = random_prompts(1, 1000, seed=2, min_len=64, max_len=64)
        prompts = random_prompts(32, 1000, seed=3, min_len=32, max_len=128)
        batch1_s, batch_s = float("inf"), float("inf")
        for _ in range(repeats):  # the best of a few: the machine may be shared
            started = time.perf_counter()
            engine.generate(one, params)
            batch1_s = min(batch1_s, time.perf_counter() - started)
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            batch_s = min(batch_s, time.perf_counter() - started)
        tokens = [o.outputs[0].token_ids for o in outs]
        return 1000 * batch1_s / max_tokens, 32 * max_tokens / batch_s, tokens
    finally:
        engine.runner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = {}
    for tp in (1, ns.tp):
        batch1_ms, tokens_per_s, tokens = run(ns.model, tp, ns.dtype, ns.max_tokens, ns.repeats)
        results[tp] = tokens
        line = "TP=%d: batch-1 decode %.1f ms/token, 32-prompt batch %.0f tokens/s"
        log.warning(line, tp, batch1_ms, tokens_per_s)
    same = sum(a == b for a, b in zip(results[1], results[ns.tp], strict=True))
    log.warning("same greedy tokens for %d of 32 prompts", same)


if __name__ == "__main__":
    main()
