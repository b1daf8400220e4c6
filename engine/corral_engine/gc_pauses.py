"""The garbage collector's passes as a Prometheus histogram: how long each held the GIL, by generation.

A pass stops every Python thread of the process: in an engine the step thread and the HTTP
server both wait, in the gateway every stream does. Young passes (generations 0 and 1) are
frequent and short; a full pass (generation 2) walks every tracked object that is not frozen
(corral_cli.heap) and is what shows in time-to-first-token tails under a burst of requests.
`gc.callbacks` gets one hook per process, however many registries expose it (an engine and a
gateway in one `corral up` process, tests); the hook costs ~1 us a pass.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import time
from collections.abc import Iterator, Mapping

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

GENERATIONS: tuple[int, ...] = (0, 1, 2)
# fmt: off
PAUSE_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
# fmt: on
_LES = [*(floatToGoString(b) for b in PAUSE_BUCKETS_S), "+Inf"]


class _Pauses:
    """Counts per generation and bucket (not cumulative; the last is +Inf's) and summed seconds.

    The collector calls the hook with the GIL held and never runs two passes at once, so one start
    time suffices and the updates need no lock. A scrape copies the lists; it can see a pass counted
    in a bucket before its seconds reach the sum, which the next scrape corrects."""

    def __init__(self) -> None:
        self.counts = [[0] * (len(PAUSE_BUCKETS_S) + 1) for _ in GENERATIONS]
        self.sums = [0.0 for _ in GENERATIONS]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        generation = info["generation"]
        self.counts[generation][bisect.bisect_left(PAUSE_BUCKETS_S, elapsed)] += 1
        self.sums[generation] += elapsed


_PAUSES = _Pauses()


def _install() -> None:
    if _PAUSES not in gc.callbacks:
        gc.callbacks.append(_PAUSES)


class GcPauseCollector(Collector):
    """The process's collector passes since the first GcPauseCollector was made, as histogram
    `name` with label `generation` ("0", "1", "2"; every one present from the first scrape) after
    the constant `labels` (an engine's model name, so a dashboard can select its replicas)."""

    def __init__(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        self._name = name
        self._labels = dict(labels or {})
        _install()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            self._name,
            "Garbage-collector passes (every thread of the process waits), by generation; "
            "generation 2 is a full pass.",
            labels=[*self._labels, "generation"],
        )
        values = list(self._labels.values())
        for generation in GENERATIONS:
            counts, total = list(_PAUSES.counts[generation]), _PAUSES.sums[generation]
            family.add_metric(
                [*values, str(generation)], list(zip(_LES, itertools.accumulate(counts), strict=True)), total
            )
        yield family
