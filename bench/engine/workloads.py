"""The engine-speed workloads (issue 8), generated once as token-id JSONL and replayed on every system.

W1: 64 requests, 128 in / 128 out, all at once.
W2: 200 requests, log-normal lengths (input median 150 clipped 8..1024, output median 120 clipped
    8..512), seed 0, all at once, ignore_eos.
S1: one request, 128 in / 256 out.
P1: 16 requests, 1,024 in / 1 out, all at once: prompt throughput (what time to first token rests
    on; offline only, opt-in: --workloads W1,W2,S1,P1).
R1: 1,500 requests, 64 in / 2 out: the server's own cost per request (`stream_cost.py --workloads
    R1 --rate 150`), not an engine-speed figure.
B1: 3,000 requests, 64 in / 2 out, all at once: a burst, for the server's garbage-collector passes
    under a deep queue (`stream_cost.py --workloads B1`), not an engine-speed figure.
Each line is {"prompt": [token ids], "output_len": N}, the JSONL `corral bench --dataset` reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from corral_cli.bench.workload import HFTokenizer, LengthSpec, allowed_token_ids, sample_lengths


@dataclass(frozen=True, slots=True)
class WorkloadDef:
    name: str
    spec: LengthSpec
    num_prompts: int
    description: str


WORKLOADS: dict[str, WorkloadDef] = {
    "W1": WorkloadDef("W1", LengthSpec(128, 128), 64, "64 x 128 in / 128 out, all at once"),
    "W2": WorkloadDef(
        "W2",
        LengthSpec(150, 120, dist="lognormal", sigma=1.0, min_len=8, max_input_len=1024, max_output_len=512),
        200,
        "200 requests, log-normal lengths (in median 150 clip 8..1024, out median 120 clip 8..512)",
    ),
    "S1": WorkloadDef("S1", LengthSpec(128, 256), 1, "1 x 128 in / 256 out"),
    "P1": WorkloadDef("P1", LengthSpec(1024, 1), 16, "16 x 1,024 in / 1 out, all at once: prompt tok/s"),
    "R1": WorkloadDef("R1", LengthSpec(64, 2), 1500, "1,500 x 64 in / 2 out: the server's cost per request"),
    "B1": WorkloadDef("B1", LengthSpec(64, 2), 3000, "3,000 x 64 in / 2 out, all at once: a burst"),
}
QUICK_NUM_PROMPTS = {"W1": 8, "W2": 12, "S1": 1, "P1": 2, "R1": 50, "B1": 50}
QUICK_MAX_OUTPUT = 32  # --quick caps output lengths so a smoke run takes seconds


def build(
    name: str, model_dir: Path, seed: int = 0, quick: bool = False, variant: int = 0
) -> list[dict[str, object]]:
    """Token-id prompts drawn from the model's vocabulary (special tokens excluded), seeded.

    Lengths depend on `seed` only; `variant` gives fresh prompt content of the same lengths (each
    served run gets its own, so no run hits a prefix cache warmed by an earlier one).
    """
    wdef = WORKLOADS[name]
    num = QUICK_NUM_PROMPTS[name] if quick else wdef.num_prompts
    in_lens, out_lens = sample_lengths(wdef.spec, num, seed)
    ids = allowed_token_ids(HFTokenizer(model_dir), None)
    rng = np.random.default_rng([seed, sum(map(ord, name)), variant])
    records: list[dict[str, object]] = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        prompt = rng.choice(ids, size=in_len).tolist()
        records.append({"prompt": prompt, "output_len": min(out_len, QUICK_MAX_OUTPUT) if quick else out_len})
    return records


def write(records: list[dict[str, object]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def summary(records: list[dict[str, object]]) -> dict[str, float]:
    ins = [len(r["prompt"]) for r in records]  # type: ignore[arg-type]
    outs = [int(r["output_len"]) for r in records]  # type: ignore[call-overload]
    return {
        "num_requests": len(records),
        "input_tokens": sum(ins),
        "output_tokens": sum(outs),
        "median_input_len": float(np.median(ins)),
        "median_output_len": float(np.median(outs)),
        "max_input_len": max(ins),
        "max_output_len": max(outs),
    }
