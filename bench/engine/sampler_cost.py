"""What the sampler alone costs: `Sampler.sample` on one [batch, vocab] float32 logits tensor.

    .venv/bin/python bench/engine/sampler_cost.py [--batch 64] [--vocab 32000] [--device cpu]

Each case gives every row the same sampling parameters (greedy; temperature 1.0; OpenAI-style
temperature 1.0 with top_p 0.9; top_k, top_p and min_p together; the last with a seed per row). The
logits are random (fixed seed), so no token is special. A case's figure is the best of `--rounds`
means of `--calls` calls, each call ending with the token ids on the host (the step's one wait).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from corral_engine.core.sequence import Request, Sequence
from corral_engine.model.sampler import Sampler
from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams

log = logging.getLogger("sampler_cost")
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "temperature 1.0, top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_k 50, top_p 0.9, min_p 0.05": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "the same, seeded": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=7),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args()


def batch_of(params: SamplingParams, size: int) -> list[Sequence]:
    seqs = []
    for i in range(size):
        request = Request(f"r{i}", [1, 2], params, arrival_order=i, metrics=RequestMetrics(arrival_time=0.0))
        seq = Sequence(i, request, 0, [1, 2], 2)
        request.seqs = [seq]
        seqs.append(seq)
    return seqs


def cost_ms(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], calls: int, rounds: int) -> float:
    sampler.sample(logits, seqs)  # first-call costs (generators, kernels) are not the steady state
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            sampler.sample(logits, seqs)  # returns host token ids: waits for the device each call
        best = min(best, 1000 * (time.perf_counter() - t0) / calls)
    return best


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(args.batch, args.vocab, generator=gen)).to(device)  # [B, V] float32
    log.info(
        "Sampler.sample on [%d, %d] float32 logits, %s, torch %s, %d threads",
        args.batch,
        args.vocab,
        device,
        torch.__version__,
        torch.get_num_threads(),
    )
    log.info("| case | ms per call (best of %d x %d calls) |\n|---|---:|", args.rounds, args.calls)
    for name, params in CASES.items():
        ms = cost_ms(Sampler(seed=0), logits, batch_of(params, args.batch), args.calls, args.rounds)
        log.info("| %s | %.3f |", name, ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
