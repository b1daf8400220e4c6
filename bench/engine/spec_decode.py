"""N-gram speculative decoding: speedup on a workload whose outputs repeat their prompts.

    .venv/bin/python bench/engine/spec_decode.py [--out-dir bench/results/spec] [--quick]

A random-weight model does not repeat its prompt, so this script first makes one that does: a Llama
(~13M parameters, the demo tokenizer, a real HF checkpoint) trained here on "document, separator,
the document again" with documents of one length (96 tokens), so it learns to quote the token 96
positions back (~100 steps, a couple of minutes on 2 cores). That is the shape of summaries, code
edits and extraction, which quote their input. It is cached in ~/.cache/corral-bench/model-copy and
loaded by the engine like any user checkpoint.

Workloads, each run with speculation off and with `--speculative ngram` at several K:
- edit: the prompt is a document, the separator and the document's first 8 tokens; the model
  continues the quote (88 tokens).
- fresh: 40 random tokens and 48 tokens out: nothing to quote, so it shows what proposals that
  fail cost.
Each at batch 1 (one request at a time, like S1) and batch 16 (16 at once). Prints a table of output
tok/s, speedup over speculation off, acceptance rate, engine steps against speculation off, and
whether greedy output is identical; writes results.json and speedup.png to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("spec_decode")
MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-copy"
SEP, FIRST_SYMBOL = 3, 4  # token ids: pad 0, bos 1, eos 2 are the demo tokenizer's
COPY_MODEL = {  # ~13M parameters (26 MB of bf16 weights read per step); learns to copy in ~2 minutes
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1536,
    "initializer_range": 0.02,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
}
NUM_SYMBOLS = 512  # documents draw from token ids FIRST_SYMBOL.. FIRST_SYMBOL + NUM_SYMBOLS - 1
DOC_LEN = 96  # one length, so the copy is always the token DOC_LEN back: learnt in ~100 steps
FRESH_LEN = 40  # control prompts: shorter than DOC_LEN, nothing to copy
QUOTED = 8  # tokens of the document repeated after the separator in the prompt


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/spec"))
    p.add_argument("--ks", default="2,4,8", help="speculative token counts to try")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--train-steps", type=int, default=2000, help="at most; stops once it copies")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-lookup-min", type=int, help="shortest n-gram that proposes (engine default)")
    p.add_argument("--quick", action="store_true", help="fewer requests and K values (a smoke run)")
    return p.parse_args()


def document(rng: random.Random, length: int) -> list[int]:
    return [FIRST_SYMBOL + rng.randrange(NUM_SYMBOLS) for _ in range(length)]


def train_copy_model(out: Path, steps: int, seed: int = 0) -> None:
    """Write a demo checkpoint of COPY_MODEL's shape, then train it to repeat documents."""
    from corral_engine.demo_model import write_demo_model
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    tmp = out.with_name(out.name + ".partial")
    write_demo_model(tmp, preset="tiny", seed=seed, config_overrides=dict(COPY_MODEL))
    model = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    warmup_then_decay = lambda s: min(1.0, (s + 1) / 100) * max(0.05, 1 - s / steps)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay)
    rng = random.Random(seed)
    recent: list[float] = []
    bar = tqdm(range(steps), desc="training the copy model", unit="step")
    for _ in bar:
        docs = [document(rng, DOC_LEN) for _ in range(16)]
        width = max(2 * len(d) + 2 for d in docs)
        ids = torch.zeros((len(docs), width), dtype=torch.long)
        labels = torch.full((len(docs), width), -100, dtype=torch.long)
        for i, d in enumerate(docs):
            seq = [1, *d, SEP, *d]
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(d) + 2 : len(seq)] = torch.tensor(d)  # loss on the repeat only
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        recent = [*recent[-19:], loss.item()]
        if len(recent) == 20 and sum(recent) / 20 < 0.01:  # copies: stop early
            break
    save_trained(model, tmp / "model.safetensors")
    tmp.rename(out)


def save_trained(model: Any, path: Path) -> None:
    """The trained weights in bf16 over the demo checkpoint's, in its one safetensors file (the
    embedding is tied, so the head is not written)."""
    from safetensors.torch import save_file

    state = {
        name: t.detach().to(torch.bfloat16).contiguous()
        for name, t in sorted(model.state_dict().items())
        if name != "lm_head.weight"
    }
    save_file(state, str(path), metadata={"format": "pt"})


def workloads(n: int, seed: int = 1) -> dict[str, list[tuple[list[int], int]]]:
    rng = random.Random(seed)
    docs = [document(rng, DOC_LEN) for _ in range(n)]
    fresh = [document(rng, FRESH_LEN) for _ in range(n)]
    return {
        "edit": [([1, *d, SEP, *d[:QUOTED]], DOC_LEN - QUOTED) for d in docs],
        "fresh": [([1, *f], DOC_LEN - FRESH_LEN - 8) for f in fresh],
    }


def run_engine(
    model: Path,
    requests: list[tuple[list[int], int]],
    batch: int,
    k: int,
    threads: int,
    min_ngram: int | None,
) -> dict[str, Any]:
    """Greedy generation of every request, `batch` at a time; k=0 turns speculation off."""
    from corral_engine.args import EngineArgs
    from corral_engine.llm_engine import LLMEngine
    from corral_engine.sampling_params import SamplingParams

    spec: dict[str, Any] = {}
    if k:
        spec = {"speculative": "ngram", "num_speculative_tokens": k}
        if min_ngram is not None:
            spec["prompt_lookup_min"] = min_ngram
    engine = LLMEngine(EngineArgs(model=str(model), dtype="bfloat16", num_threads=threads, **spec))
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate([requests[0][0]], [warm])
    before = engine.stats()
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in chunk]
        outputs += [list(o.outputs[0].token_ids) for o in engine.generate([p for p, _ in chunk], params)]
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    tokens = sum(len(o) for o in outputs)
    proposed = stats.num_spec_proposed_total - before.num_spec_proposed_total
    accepted = stats.num_spec_accepted_total - before.num_spec_accepted_total
    steps = stats.num_steps_total - before.num_steps_total
    return {
        "k": k,
        "batch": batch,
        "seconds": elapsed,
        "output_tokens": tokens,
        "tok_s": tokens / elapsed,
        "steps": steps,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": accepted / proposed if proposed else None,
        "outputs": outputs,
    }


def copy_accuracy(requests: list[tuple[list[int], int]], outputs: list[list[int]]) -> float:
    """Share of output tokens equal to the document's next token (edit workload)."""
    hits = total = 0
    for (prompt, _), out in zip(requests, outputs, strict=True):
        doc = prompt[1 : prompt.index(SEP)]
        want = doc[QUOTED:]
        hits += sum(a == b for a, b in zip(out, want, strict=False))
        total += len(want)
    return hits / total


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, batch in zip(axes, sorted({r["batch"] for r in rows}), strict=False):
        for workload, marker in (("edit", "o"), ("fresh", "s")):
            mine = [r for r in rows if r["batch"] == batch and r["workload"] == workload]
            pts = sorted((r["k"], r["speedup"]) for r in mine)
            ax.plot([k for k, _ in pts], [s for _, s in pts], marker=marker, label=workload)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("speculative tokens K (0 = off)")
        ax.legend()
    axes[0].set_ylabel("output tok/s vs speculation off")
    fig.suptitle("n-gram speculative decoding, copy-trained model (bf16, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("corral_engine").setLevel(logging.WARNING)
    args = parse_args()
    torch.manual_seed(0)
    if not (args.model / "config.json").is_file():
        log.info("training the copy model into %s (one time, a few minutes)", args.model)
        train_copy_model(args.model, args.train_steps)
    ks = [int(k) for k in args.ks.split(",")]
    n = args.num_requests
    if args.quick:
        ks, n = ks[:1], 4
    loads = workloads(n)
    rows: list[dict[str, Any]] = []
    for workload, requests in loads.items():
        for batch in (1, 16):
            base: dict[str, Any] | None = None
            for k in [0, *ks]:
                r = run_engine(args.model, requests, batch, k, args.threads, args.prompt_lookup_min)
                base = base or r
                r.update(
                    workload=workload,
                    speedup=r["tok_s"] / base["tok_s"],
                    identical=r["outputs"] == base["outputs"],
                    step_ratio=r["steps"] / base["steps"],
                )
                if workload == "edit":
                    r["copy_accuracy"] = copy_accuracy(requests, r["outputs"])
                log.info(
                    "%-5s batch %2d K=%d: %7.1f tok/s  x%.2f  acceptance %s  identical %s",
                    workload, batch, k, r["tok_s"], r["speedup"],
                    "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}", r["identical"],
                )  # fmt: skip
                rows.append({key: v for key, v in r.items() if key != "outputs"})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": COPY_MODEL,
        "torch": torch.__version__,
        "threads": args.threads,
        "num_requests": n,
        "prompt_lookup_min": args.prompt_lookup_min,
        "engine_rev": _git_rev(),
    }
    (args.out_dir / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, args.out_dir / "speedup.png")
    lines = [
        "| workload | batch | K | output tok/s | speedup | acceptance | steps vs off | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['k']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {acc} "
            f"| {r['step_ratio']:.2f} | {'yes' if r['identical'] else 'no'} |"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    log.info("wrote %s", args.out_dir)
    return 0


def _git_rev() -> str:
    cmd = ["git", "rev-parse", "--short", "HEAD"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
