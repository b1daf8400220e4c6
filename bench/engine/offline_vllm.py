"""Offline worker: vLLM's CPU build, `LLM.generate` with token-id prompts and ignore_eos.

The harness starts it with vLLM's CPU settings in the environment: tcmalloc and libiomp5 in
LD_PRELOAD, VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE, VLLM_TARGET_DEVICE=cpu.
"""

from __future__ import annotations

import importlib.metadata

import torch
from vllm import LLM, SamplingParams
from worker_common import Request, load_workloads, parse_args, run_all, setup_logging


def main() -> int:
    setup_logging()
    args = parse_args()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
    )

    def generate(requests: list[Request]) -> int:
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        params = [
            SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True) for _, n in requests
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    info = {
        "torch": torch.__version__,
        "vllm": importlib.metadata.version("vllm-cpu"),
        "threads": torch.get_num_threads(),
        "settings": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_gib": args.kv_cache_gib,
        },
    }
    run_all("vllm", generate, load_workloads(args.workload), info, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
