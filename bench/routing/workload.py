"""The routing benchmark's workload (pure): shared document prefixes, unique prompts, long and short outputs.

Requests sharing a document reuse the same prompt head, so a policy that keeps them on one replica
turns repeated prefills into prefix-cache hits.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from corral_cli.bench.workload import BenchRequest

# 64 made-up words; the demo tokenizer splits them into a few tokens each.
WORDS = [
    a + b
    for a in ("ka", "lo", "mi", "ru", "se", "ta", "vo", "ne")
    for b in ("ber", "dan", "fel", "gor", "lin", "mur", "pas", "tov")
]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int = 300
    num_documents: int = 8
    document_tokens: int = 200
    question_tokens: int = 16
    unique_prompt_tokens: int = 64
    shared_fraction: float = 0.7  # requests that start with one of the documents
    short_output_tokens: int = 16
    long_output_tokens: int = 200
    long_fraction: float = 0.2
    max_model_len: int = 512  # prompt + output must fit


def _text(rng: random.Random, num_tokens: int, count_tokens: Callable[[str], int]) -> str:
    words: list[str] = []
    while True:
        words.append(rng.choice(WORDS))
        if len(words) % 8 == 0 and count_tokens(" ".join(words)) >= num_tokens:
            return " ".join(words)


def build_requests(
    spec: WorkloadSpec, seed: int, count_tokens: Callable[[str], int], text_seed: int | None = None
) -> list[BenchRequest]:
    """A shuffled list of requests. `seed` fixes the shape (which document each request asks
    about, long or short); `text_seed` (default: `seed`) the words. Runs that compare policies share
    the shape and differ in the words, so each starts with cold prefix caches on the same traffic."""
    rng = random.Random(seed)
    text_seed = seed if text_seed is None else text_seed
    words = random.Random(text_seed)
    documents = [
        f"Document {text_seed}-{i}: " + _text(words, spec.document_tokens, count_tokens)
        for i in range(spec.num_documents)
    ]
    requests: list[BenchRequest] = []
    for i in range(spec.num_requests):
        if rng.random() < spec.shared_fraction:
            # Popular documents are asked about more often (Zipf-like), as in real traffic.
            doc = documents[min(int(rng.paretovariate(1.2)) - 1, spec.num_documents - 1)]
            prompt = f"{doc}\nQuestion {i}: " + _text(words, spec.question_tokens, count_tokens)
        else:
            prompt = f"Note {text_seed}-{i}: " + _text(words, spec.unique_prompt_tokens, count_tokens)
        is_long = rng.random() < spec.long_fraction
        output_len = spec.long_output_tokens if is_long else spec.short_output_tokens
        prompt_len = count_tokens(prompt)
        output_len = max(1, min(output_len, spec.max_model_len - prompt_len - 8))
        requests.append(BenchRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    return requests
