"""The garbage collector's passes as a histogram (corral_engine.gc_pauses) on both servers' /metrics."""

from __future__ import annotations

import gc
import itertools

from corral_engine import wire
from corral_engine.gc_pauses import GENERATIONS, GcPauseCollector
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str, str], float]:
    text = generate_latest(registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {(s.name, s.labels["generation"], s.labels.get("le", "")): s.value for s in family.samples}


def test_each_pass_is_counted_under_its_generation_with_its_time() -> None:
    registry = CollectorRegistry()
    registry.register(GcPauseCollector("test_gc_pause_seconds"))
    before = _samples(registry, "test_gc_pause_seconds")
    assert {g for (_, g, _) in before} == {str(g) for g in GENERATIONS}  # every generation from the start
    gc.collect(2)
    gc.collect(2)
    gc.collect(0)
    after = _samples(registry, "test_gc_pause_seconds")
    count = "test_gc_pause_seconds_count"
    assert after[count, "2", ""] - before[count, "2", ""] == 2
    assert after[count, "0", ""] - before[count, "0", ""] >= 1
    assert after["test_gc_pause_seconds_sum", "2", ""] > before["test_gc_pause_seconds_sum", "2", ""]
    # cumulative buckets: +Inf holds every pass, and no bucket holds more than the next one up
    buckets = sorted(
        ((float(le), v) for (n, g, le), v in after.items() if n.endswith("_bucket") and g == "2"),
    )
    assert buckets[-1] == (float("inf"), after[count, "2", ""])
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))


def test_one_hook_per_process_however_many_registries() -> None:
    GcPauseCollector("a_seconds")
    GcPauseCollector("b_seconds")
    assert sum(type(cb).__name__ == "_Pauses" for cb in gc.callbacks) == 1


def test_the_engine_and_the_gateway_expose_it() -> None:
    from corral_engine.outputs import EngineStats
    from corral_engine.server.metrics import ServerMetrics
    from corral_gateway.metrics import GC_PAUSE_SECONDS, GatewayMetrics

    engine = ServerMetrics(lambda: EngineStats(), "m", max_model_len=128)
    # the engine's carry its model's name, as its other series do, so a dashboard can select them
    assert f'{wire.GC_PAUSE_SECONDS}_count{{generation="2",model_name="m"}}' in engine.render().decode()
    assert f'{GC_PAUSE_SECONDS}_count{{generation="2"}}' in GatewayMetrics().render().decode()
