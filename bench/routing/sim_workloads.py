"""The simulated-fleet benchmark's workloads (pure, generated locally from a seed): token-id prompts
with ShareGPT-like lengths, multi-turn chats whose prompts grow by whole turns, RAG over a corpus
larger than one replica's KV cache, each with Poisson or bursty (gamma) arrivals.

Prompts are token ids, so the gateway's prefix hashes come from the same code path as a request
with `"prompt": [ids]` (`peek.prompt_prefix` and `block_prefix_hash`). A chat's next turn carries
the reply the simulated engine really produced (it cycles through the prompt's ids), so the cached
KV of a reply is reused as it would be on a real engine.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from corral_cli.bench.arrivals import arrival_offsets_s
from corral_gateway.peek import RequestInfo, block_hash_chain, block_prefix_hash, for_adapter, prompt_prefix

WORKLOADS = ("sharegpt", "chat", "rag")
VOCAB = 32_000
BLOCK_CHARS, NUM_BLOCKS, CHAIN_BLOCKS = 64, 4, 256  # the gateway's defaults
# Chat sessions: a reply takes about this long a token (TPOT near capacity is 15-25 ms), and
# sessions start up to CHAT_LEAD_S before the window (8 long turns), 5.5 turns each on average.
REPLY_S_PER_TOKEN, CHAT_LEAD_S, CHAT_MEAN_TURNS = 0.025, 120.0, 5.5


@dataclass(slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt: list[int]
    output_len: int
    is_counted: bool = True  # False: sent during the warm-up, left out of the figures
    prefix_hash: int | None = None
    block_hashes: tuple[int, ...] = field(default_factory=tuple)
    adapter: str | None = None  # the LoRA adapter it names as its model; None: the base model

    def hash_prefix(self) -> None:
        """What the gateway's peek computes for `{"prompt": ids}` (mixed with its adapter's name)."""
        body = {"prompt": self.prompt}
        head = prompt_prefix(body, BLOCK_CHARS * NUM_BLOCKS)
        self.prefix_hash = None if head is None else block_prefix_hash(head, BLOCK_CHARS, NUM_BLOCKS)
        chain_text = prompt_prefix(body, BLOCK_CHARS * CHAIN_BLOCKS) or ""
        self.block_hashes = block_hash_chain(chain_text, BLOCK_CHARS, CHAIN_BLOCKS)
        if self.adapter is not None:
            info = for_adapter(RequestInfo(None, True, self.prefix_hash, 0, self.block_hashes), self.adapter)
            self.prefix_hash, self.block_hashes = info.prefix_hash, info.block_hashes


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    num_requests: int
    rate: float  # requests per second, mean
    burstiness: float = 1.0  # gamma shape of the gaps: 1 Poisson, < 1 bursty
    num_replicas: int = 16  # sizes the RAG corpus and the chat population
    max_model_len: int = 8192
    seed: int = 0
    warmup_s: float = 0.0  # chat: arrivals sent before the `num_requests / rate` window, not counted


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(rng.lognormvariate(math.log(median), sigma))))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def reply_of(prompt: list[int], output_len: int) -> list[int]:
    """The tokens the simulated engine answers `prompt` with (`SimEngine` cycles its ids)."""
    return [prompt[i % len(prompt)] for i in range(output_len)]


def build(spec: WorkloadSpec) -> list[SimRequest]:
    builders = {"sharegpt": _sharegpt, "chat": _chat, "rag": _rag}
    if spec.name not in builders:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")
    requests = builders[spec.name](spec, random.Random(spec.seed))
    requests.sort(key=lambda r: r.arrival_s)
    for r in requests:
        r.hash_prefix()
    return requests


def _sharegpt(spec: WorkloadSpec, rng: random.Random) -> list[SimRequest]:
    """Independent conversations' first turns: prompts ~ 180 tokens (median, long tail to 3,000),
    replies ~ 120 (to 1,000), as in ShareGPT; no shared prefixes beyond chance."""
    offsets = arrival_offsets_s(spec.num_requests, spec.rate, spec.burstiness, spec.seed)
    out = []
    for i, at in enumerate(offsets):
        prompt = _ids(rng, _lognormal(rng, 180, 1.0, 8, 3000))
        out.append(SimRequest(f"s{i}", at, prompt, _lognormal(rng, 120, 0.9, 4, 1000)))
    return out


def _chat(spec: WorkloadSpec, rng: random.Random) -> list[SimRequest]:
    """Sessions of 3-8 turns under one of 4 system prompts (400 tokens); each turn's prompt is the
    whole conversation so far plus a new user message; the next turn comes 2-6 s after the reply
    would have ended at `REPLY_S_PER_TOKEN`. Sessions start before the window too, so the window
    holds a steady population and its arrival rate is `rate`: their turns in the `warmup_s` before
    the window are sent (so the replies a counted turn carries can be cached) but not counted,
    earlier ones are not sent (their KV is cached nowhere). At an infinite rate (capacity runs),
    one turn of each session, anywhere in it, all at 0, with its history cached nowhere: the mix of
    prompt lengths a steady population sends, as round-robin mostly meets it."""
    systems = [_ids(rng, 400) for _ in range(4)]
    out: list[SimRequest] = []
    if not math.isfinite(spec.rate):
        while len(out) < spec.num_requests:
            chosen = rng.randint(0, 7)  # sessions shorter than that send nothing
            system = rng.choice(systems)
            out += _session(spec, rng, f"c{len(out)}", system, 0.0, functools.partial(_is_turn, chosen))
        return out
    window_s = spec.num_requests / spec.rate
    num_sessions = max(1, round(spec.rate * (window_s + CHAT_LEAD_S) / CHAT_MEAN_TURNS))
    starts = arrival_offsets_s(
        num_sessions, num_sessions / (window_s + CHAT_LEAD_S), spec.burstiness, spec.seed
    )

    def is_sent(_: int, at: float) -> bool:
        return -spec.warmup_s <= at < window_s

    for s, start in enumerate(starts):
        out += _session(spec, rng, f"c{s}", rng.choice(systems), start - CHAT_LEAD_S, is_sent)
    return out


def _is_turn(chosen: int, turn: int, _: float) -> bool:
    return turn == chosen


def _session(
    spec: WorkloadSpec,
    rng: random.Random,
    name: str,
    system: list[int],
    start_s: float,
    is_sent: Callable[[int, float], bool],
) -> list[SimRequest]:
    """One chat session's turns that `is_sent(turn, at)`, timed from `start_s` (warm-up shifted)."""
    out: list[SimRequest] = []
    history = list(system)
    num_unsent = 0  # tokens of turns not sent: random ids once a later turn is sent
    at = start_s
    for turn in range(rng.randint(3, 8)):
        num_new, output_len = _lognormal(rng, 60, 0.8, 4, 600), _lognormal(rng, 150, 0.8, 4, 800)
        if len(history) + num_unsent + num_new + output_len > spec.max_model_len:
            break
        if not is_sent(turn, at):
            num_unsent += num_new + output_len
        else:
            history += _ids(rng, num_unsent)
            num_unsent = 0
            prompt = history + _ids(rng, num_new)
            out.append(SimRequest(f"{name}-{turn}", at + spec.warmup_s, prompt, output_len, at >= 0.0))
            history = prompt + reply_of(prompt, output_len)
        if math.isfinite(spec.rate):
            at += output_len * REPLY_S_PER_TOKEN + rng.uniform(2.0, 6.0)
    return out


def _rag(spec: WorkloadSpec, rng: random.Random) -> list[SimRequest]:
    """Questions about documents of 1,500-4,000 tokens, 32 per replica (together ~3x what one
    H100 replica's KV cache holds, a fifth of the fleet's), chosen by a Zipf(1.1) popularity."""
    system = _ids(rng, 60)
    docs = [_ids(rng, rng.randint(1500, 4000)) for _ in range(32 * spec.num_replicas)]
    weights = [1.0 / (k + 1) ** 1.1 for k in range(len(docs))]
    offsets = arrival_offsets_s(spec.num_requests, spec.rate, spec.burstiness, spec.seed)
    chosen = rng.choices(range(len(docs)), weights, k=len(offsets))
    out = []
    for i, (at, d) in enumerate(zip(offsets, chosen, strict=True)):
        prompt = system + docs[d] + _ids(rng, _lognormal(rng, 40, 0.6, 4, 300))
        out.append(SimRequest(f"r{i}", at, prompt, _lognormal(rng, 80, 0.7, 4, 600)))
    return out


@dataclass(frozen=True, slots=True)
class AdapterMix:
    """Which LoRA adapter requests name: `num_adapters` of Zipf(`zipf_s`) popularity, and a
    `base_share` of requests for the base model."""

    num_adapters: int = 64
    zipf_s: float = 1.0
    base_share: float = 0.2
    seed: int = 0

    def names(self) -> list[str]:
        return [f"adapter-{k}" for k in range(self.num_adapters)]


def with_adapters(requests: list[SimRequest], mix: AdapterMix) -> list[SimRequest]:
    """`requests` (in place, and returned) each naming an adapter of `mix` or the base model, their
    prefix hashes mixed with it as the gateway mixes them."""
    rng = random.Random(mix.seed + 11)
    names = mix.names()
    weights = [1.0 / (k + 1) ** mix.zipf_s for k in range(len(names))]
    for r in requests:
        r.adapter = None if rng.random() < mix.base_share else rng.choices(names, weights)[0]
        r.hash_prefix()
    return requests
