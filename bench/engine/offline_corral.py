"""Offline worker: Corral's Python API (`LLMEngine.generate` with token-id prompts), one process.

Runs in Corral's own venv or in the vLLM venv (Corral installed there --no-deps: the same torch).
"""

from __future__ import annotations

import torch
from corral_cli.heap import freeze_startup_heap
from corral_engine.args import EngineArgs
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams
from worker_common import Request, load_workloads, parse_args, run_all, setup_logging


def main() -> int:
    setup_logging()
    args = parse_args()
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            dtype="bfloat16",
            num_threads=args.threads,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        )
    )

    # As `corral engine` does after loading (and vLLM's engine core): the collector's full passes
    # skip the startup heap, so the offline and served runs collect alike.
    freeze_startup_heap()

    def generate(requests: list[Request]) -> int:
        params = [
            SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True) for _, n in requests
        ]
        outputs = engine.generate([p for p, _ in requests], params)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    info = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "settings": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_gib": args.kv_cache_gib,
        },
    }
    run_all("corral", generate, load_workloads(args.workload), info, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
