"""The sampler's penalties on hand-made logits: each one must move the greedy pick, by the formula
OpenAI and vLLM document (frequency and presence on output tokens; repetition on every token seen)."""

from __future__ import annotations

import pytest
import torch
from corral_engine.core.sequence import Request, Sequence
from corral_engine.model.sampler import Sampler
from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams

PROMPT = [1, 2]
VOCAB = 8


def _seq(params: SamplingParams, output: list[int]) -> Sequence:
    request = Request("r", PROMPT, params, arrival_order=0, metrics=RequestMetrics(arrival_time=0.0))
    seq = Sequence(0, request, 0, [*PROMPT, *output], len(PROMPT))
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
