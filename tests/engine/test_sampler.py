"""The sampler on hand-made logits: each penalty must move the greedy pick, by the formula OpenAI and
vLLM document (frequency and presence on output tokens; repetition on every token seen); temperature,
top_k, top_p and min_p must draw from the truncated, renormalised distribution, each row by its own
parameters; a seeded row must draw what it would alone, whatever shares the batch."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable

import pytest
import torch
from corral_engine.core.sequence import Request, Sequence
from corral_engine.model import native
from corral_engine.model import sampler as sampler_module
from corral_engine.model.sampler import Sampler, sample_rows
from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

PROMPT = [1, 2]
VOCAB = 8
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
# How the noise is drawn on the CPU: PyTorch's exponential_, or the native kernel the engine uses.
RACES = ["torch", "native"]


def _race(kind: str) -> sampler_module.ExponentialRace | None:
    if kind == "torch":
        return None
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the native exponential race")
    ops = native.load_fused_ops(EngineSettings(native_kernels=True))
    assert ops is not None
    return ops.exponential_race


def _seq(params: SamplingParams, output: list[int], seq_id: int = 0) -> Sequence:
    request = Request(
        f"r{seq_id}", PROMPT, params, arrival_order=seq_id, metrics=RequestMetrics(arrival_time=0.0)
    )
    seq = Sequence(seq_id, request, 0, [*PROMPT, *output], len(PROMPT))
    request.seqs = [seq]
    return seq


def _pick(logits: list[float], params: SamplingParams, output: list[int]) -> int:
    return Sampler().sample(torch.tensor([logits]), [_seq(params, output)]).token_ids[0]


# Token 3 leads token 4 by 1.0; token 3 appeared twice in the output, token 1 in the prompt.
LOGITS = [0.0, 6.0, -1.0, 5.0, 4.0, 0.0, 0.0, -3.0]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize(
    ("penalties", "output", "picked"),
    [
        ({}, [3, 3], 1),  # no penalty: the top logit wins
        ({"frequency_penalty": 0.6}, [1], 1),  # 6 - 0.6 = 5.4 still leads 5
        ({"frequency_penalty": 0.6}, [1, 1, 1], 3),  # per occurrence: 6 - 1.8 = 4.2 < 5
        ({"frequency_penalty": 2.0}, [], 1),  # prompt tokens are not penalised
        ({"presence_penalty": 1.5}, [1], 3),  # 6 - 1.5 = 4.5 < 5
        ({"presence_penalty": 0.5}, [1, 1, 1], 1),  # once, however often: 5.5 still leads
        ({"presence_penalty": -2.0}, [3], 3),  # negative favours what was said: 5 + 2 = 7 > 6
    ],
)
def test_frequency_and_presence_penalties(
    penalties: dict[str, float], output: list[int], picked: int
) -> None:
    assert _pick(LOGITS, GREEDY.replace(**penalties), output) == picked


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    params = GREEDY.replace(repetition_penalty=2.0)
    assert _pick(LOGITS, params, []) == 3  # token 1 is in the prompt: 6 / 2 = 3 < 5
    assert _pick(LOGITS, params, [3]) == 4  # 3 seen too: 5 / 2 = 2.5 < 4
    negative = [-0.8, -3.0, -0.5, -9.0, -9.0, -9.0, -9.0, -9.0]  # token 2 (in the prompt) leads
    assert _pick(negative, GREEDY, []) == 2
    assert _pick(negative, params, []) == 0  # -0.5 * 2 = -1.0 < -0.8


def _expected(logits: list[float], params: SamplingParams) -> list[float]:
    """The distribution a row must be drawn from, in float64: temperature, top_k, softmax, top_p
    (the smallest most-probable set reaching it), min_p, renormalised."""
    scaled = [x / params.temperature for x in logits]
    if params.top_k:
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    weights = [math.exp(x - max(scaled)) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= params.top_p:
            break
        kept.add(i)
        mass += probs[i]
    probs = [p if i in kept and p >= params.min_p * max(probs) else 0.0 for i, p in enumerate(probs)]
    return [p / sum(probs) for p in probs]


# Probabilities at temperature 1, most probable first: token 1 .566, 0 .170, 3 .126, 2 .063, 4 .042,
# 5 .023, 6 .0085, 7 .0011 (cumulative .566 .736 .863 .925 .967 .990 .999 1).
ROW = [2.0, 3.2, 1.0, 1.7, 0.6, 0.0, -1.0, -3.0]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=4)
CASES = [
    SAMPLED,
    SAMPLED.replace(temperature=0.5),
    SAMPLED.replace(temperature=1.7),
    SAMPLED.replace(top_k=3),  # tokens 1, 0, 3
    SAMPLED.replace(top_p=0.8),  # tokens 1, 0, 3: .736 < .8 <= .863
    SAMPLED.replace(top_p=0.5),  # token 1 alone: .566 already reaches .5
    SAMPLED.replace(min_p=0.1),  # drops p < .0566: tokens 4, 5, 6, 7
    SAMPLED.replace(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows_per_pass", [None, 1000], ids=["one pass", "passes of 1000 rows"])
def test_each_row_draws_from_its_own_truncated_distribution(
    device: str, rows_per_pass: int | None, race: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch holds every case's rows, interleaved; each case's empirical frequencies match its
    renormalised distribution (within 5 standard errors), and what it truncates is never drawn."""
    if rows_per_pass is not None:
        monkeypatch.setattr(sampler_module, "MAX_SAMPLED_LOGITS", rows_per_pass * len(ROW))
    per_case = 3000
    seqs = [_seq(CASES[i % len(CASES)], [], i) for i in range(per_case * len(CASES))]
    sampler = Sampler(seed=3, race=_race(race))
    drawn = sampler.sample(torch.tensor([ROW] * len(seqs), device=device), seqs).token_ids
    for c, params in enumerate(CASES):
        tokens = drawn[c :: len(CASES)]
        for token, p in enumerate(_expected(ROW, params)):
            freq = tokens.count(token) / per_case
            assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / per_case), (params, token, freq, p)


@pytest.mark.parametrize(
    "params",
    [SAMPLED.replace(top_k=1), SAMPLED.replace(top_p=1e-6), SAMPLED.replace(min_p=1.0, temperature=1.5)],
)
def test_truncation_to_one_token_is_greedy(params: SamplingParams) -> None:
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(1))  # no ties
    drawn = sample_rows(logits, [params] * 32, torch.Generator().manual_seed(2), {})
    assert drawn.tolist() == logits.argmax(dim=-1).tolist()


def _row_at_a_time(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The sampler before batching (one row, one op at a time): the reference a seeded row must match."""
    row = row / params.temperature
    if 0 < params.top_k < row.shape[0]:
        row = row.masked_fill(row < torch.topk(row, params.top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.argmax(probs / torch.empty_like(probs).exponential_(1.0, generator=generator)))


MIXED = [
    SAMPLED.replace(temperature=0.7, seed=11),
    SAMPLED.replace(temperature=1.3, top_k=20, seed=12),
    SAMPLED.replace(top_p=0.9, seed=13),
    SAMPLED.replace(temperature=0.9, top_k=50, top_p=0.6, seed=14),
    SAMPLED.replace(min_p=0.05, seed=15),
    SAMPLED.replace(temperature=1.1, top_k=7, min_p=0.2, seed=16),
]


@pytest.mark.parametrize(
    "batch",
    [MIXED, [p for p in MIXED if p.top_p == 1.0], [p.replace(top_k=0) for p in MIXED if p.top_p == 1.0]],
    ids=["top_p sorts", "top_k alone", "temperature and min_p"],
)
@pytest.mark.parametrize("rows_per_pass", [None, 2], ids=["one pass", "passes of 2 rows"])
def test_seeded_rows_draw_what_the_row_at_a_time_sampler_drew(
    batch: list[SamplingParams], rows_per_pass: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rows_per_pass is not None:
        monkeypatch.setattr(sampler_module, "MAX_SAMPLED_LOGITS", rows_per_pass * 1000)
    seqs = [_seq(params, [], i) for i, params in enumerate(batch)]
    gens = [torch.Generator().manual_seed(params.seed or 0) for params in batch]  # seed + index 0
    sampler = Sampler()
    logits_gen = torch.Generator().manual_seed(5)
    for _ in range(6):  # each sequence's generator carries on across steps
        logits = 4 * torch.randn(len(batch), 1000, generator=logits_gen)
        want = [_row_at_a_time(logits[i], p, gens[i]) for i, p in enumerate(batch)]
        assert sampler.sample(logits, seqs).token_ids == want


@pytest.mark.parametrize(
    "others",
    [
        [GREEDY, SAMPLED, SAMPLED.replace(top_p=0.7), SAMPLED.replace(top_k=5, seed=1)],
        [GREEDY, SAMPLED.replace(top_k=5), GREEDY, SAMPLED.replace(top_k=40, seed=1)],
        [SAMPLED, SAMPLED.replace(seed=1), SAMPLED.replace(temperature=0.3), GREEDY],
    ],
    ids=["top_p sorts", "top_k", "plain"],
)
@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(
    others: list[SamplingParams], device: str, race: str
) -> None:
    """The same seeded sequence, alone and among greedy, unseeded and other seeded rows whose
    top_p and top_k change how the batch is processed: the same tokens, step after step."""
    ours = SAMPLED.replace(temperature=0.9, min_p=0.02, seed=99)
    logits_gen = torch.Generator().manual_seed(8)
    steps = [4 * torch.randn(len(others) + 1, 300, generator=logits_gen).to(device) for _ in range(8)]
    alone = Sampler(seed=1, race=_race(race))
    seq = _seq(ours, [], 7)
    drawn_alone = [alone.sample(logits[2:3], [seq]).token_ids[0] for logits in steps]
    batched = Sampler(seed=2, race=_race(race))
    seqs = [_seq(p, [], i) for i, p in enumerate(others)]
    seqs.insert(2, _seq(ours, [], 7))
    drawn = [batched.sample(logits, seqs).token_ids for logits in steps]
    assert [tokens[2] for tokens in drawn] == drawn_alone
    for tokens, logits in zip(drawn, steps, strict=True):
        assert all(tokens[i] == logits[i].argmax() for i, s in enumerate(seqs) if s.request.params.is_greedy)
    assert len(set(drawn_alone)) > 1  # it does sample


@needs_cuda
def test_sampling_queues_on_the_gpu_without_waiting_for_it() -> None:
    """Everything up to the token ids' copy to the host is queued: no step waits for the device
    (the engine works on the host meanwhile), greedy, seeded and unseeded rows mixed."""
    batch = [GREEDY, *MIXED, SAMPLED, SAMPLED.replace(top_p=0.5)]
    seqs = [_seq(params, [], i) for i, params in enumerate(batch)]
    logits = torch.randn(len(batch), 1000, device="cuda")
    sampler = Sampler()
    greedy = torch.max(logits, dim=-1).indices
    sampler.sample(logits, seqs)  # the generators are made (and seeded) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampled = [row for row, s in enumerate(seqs) if not s.request.params.is_greedy]
        tokens = sampler._sample_rows(logits, greedy, seqs, sampled)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens[0] == greedy[0]


def test_the_race_on_logits_draws_what_the_race_on_their_softmax_draws() -> None:
    """The native race given logits and temperatures does the softmax itself: with the same seeds,
    the same token as the race on softmax(logits / t), row for row, and a -inf logit (a masked
    token) is never drawn."""
    race = _race("native")
    assert race is not None
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 2000, 300
    logits = 3 * torch.randn(rows, vocab, generator=gen)
    logits[:, 7] = float("-inf")
    temperatures = torch.tensor([0.3, 1.0, 1.7, 4.0]).repeat(rows // 4)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    from_logits = race(logits, seeds, temperatures)
    from_probs = race(torch.softmax(logits / temperatures[:, None], dim=-1), seeds)
    assert int((from_logits != from_probs).sum()) <= 2  # a near-tie may round the other way
    assert not bool((from_logits == 7).any())


@pytest.mark.parametrize("race", RACES)
def test_rows_sampled_at_a_temperature_alone_race_on_the_logits(race: str) -> None:
    """A pass whose rows have no top-k, top-p or min-p hands the native race the logits and the
    temperatures (no probability tensor); any truncation in the pass takes the probabilities' path.
    Either way each temperature's frequencies are its softmax's."""
    calls: list[bool] = []
    native_race = _race(race)

    def spy(
        probs: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor | None = None
    ) -> torch.Tensor:
        calls.append(temperatures is not None)
        assert native_race is not None
        return native_race(probs, seeds, temperatures)

    plain = [SAMPLED, SAMPLED.replace(temperature=1.7)]
    per_case = 3000
    for batch, logits_path in ((plain, True), ([*plain, SAMPLED.replace(top_p=0.8)], False)):
        calls.clear()
        seqs = [_seq(batch[i % len(batch)], [], i) for i in range(per_case * len(batch))]
        sampler = Sampler(seed=3, race=spy if native_race is not None else None)
        drawn = sampler.sample(torch.tensor([ROW] * len(seqs)), seqs).token_ids
        assert calls == ([logits_path] if native_race is not None else [])
        for c, params in enumerate(plain):
            tokens = drawn[c :: len(batch)]
            for token, p in enumerate(_expected(ROW, params)):
                freq = tokens.count(token) / per_case
                assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / per_case), (params, token, freq, p)


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("temperature", [1e-39, 1e-8])
def test_a_vanishing_temperature_is_greedy(race: str, temperature: float) -> None:
    """logits / 1e-39 overflow float32 (every path then drew noise); below vLLM's 1e-5 the
    request is greedy, as the temperature's limit is."""
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(9))
    drawn = Sampler(race=_race(race)).sample(logits, [_seq(params, [], i) for i in range(6)]).token_ids
    assert drawn == logits.argmax(dim=-1).tolist()


def _native_argmax() -> Callable[[torch.Tensor], torch.Tensor]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the native argmax")
    ops = native.load_fused_ops(EngineSettings(native_kernels=True))
    assert ops is not None
    return ops.argmax_rows


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 17), (128, 32000), (5, 151936), (0, 8)])
def test_native_argmax_picks_what_torch_max_picks(rows: int, vocab: int) -> None:
    """Greedy rows through the native argmax: torch.max's indices, ties to the first index, a -inf
    or +inf logit, and a NaN (which torch.max picks) included."""
    argmax = _native_argmax()
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    if rows >= 3 and vocab >= 17:
        logits[0, 5] = logits[0, vocab - 1] = logits[0].max() + 1.0  # a tie: the first wins
        logits[1, :] = float("-inf")
        logits[1, 9] = -1e30  # the only finite logit of a masked row
        logits[2, 3] = float("inf")
        logits[2, 11] = float("inf")
    if rows >= 5 and vocab >= 17:
        logits[3, 12] = float("nan")
        logits[3, 4] = float("nan")
        logits[4, :] = 0.0  # all tie
    got = argmax(logits)
    assert got.dtype == torch.long and got.tolist() == torch.max(logits, dim=-1).indices.tolist()
    # a view that is not contiguous is read as its values
    assert argmax(logits.t().contiguous().t()).tolist() == got.tolist()


def test_greedy_rows_take_the_native_argmax_on_cpu_logits() -> None:
    calls: list[tuple[int, ...]] = []
    argmax = _native_argmax()

    def counting(logits: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return argmax(logits)

    sampler = Sampler(argmax=counting)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    seqs = [_seq(GREEDY, [], 0), _seq(sampled, [], 1), _seq(GREEDY, [3], 2)]
    logits = torch.tensor([LOGITS, LOGITS, [0.0, -1.0, 2.0, 9.0, 0.0, 0.0, 0.0, 0.0]])
    got = sampler.sample(logits, seqs).token_ids
    assert calls == [(3, VOCAB)]
    assert got[0] == 1 and got[2] == 3
    assert got == Sampler().sample(logits, seqs).token_ids  # the same picks as torch.max's
    with pytest.raises(native.NativeKernelError):
        argmax(torch.zeros(2, 8, dtype=torch.bfloat16))
