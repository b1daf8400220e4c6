"""Two sides of one engine timed in one process: the same greedy batch generated through each, the
order flipping every round so a drifting machine favours neither (native_ops_ab.py,
amx_linear_ab.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams


def alternate_rounds(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    use: Callable[[bool], None],
    sides: tuple[str, str],
    rounds: int,
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Seconds per run of each side (`use(False)` selects sides[0], `use(True)` sides[1]) over
    `rounds` rounds after one warm-up run each, and each side's last token ids per sequence."""

    def run() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    for on in (False, True):  # warm-up
        use(on)
        run()
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(rounds):
        for side in sides if round_index % 2 == 0 else sides[::-1]:
            use(side == sides[1])
            elapsed, tokens[side] = run()
            seconds[side].append(elapsed)
    return seconds, tokens
