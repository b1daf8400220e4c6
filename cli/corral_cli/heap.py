"""The serving processes' startup heap, kept out of the garbage collector's full passes.

Everything a server builds before it serves (torch, transformers, FastAPI, the model, the app:
~420,000 objects in an engine, ~63,000 in the gateway) stays alive until it exits, yet every pass
over the collector's oldest generation walks all of it, holding the GIL: on a 2-core AVX2 machine
~380 ms a pass in an engine (the step thread and the server both stop) and ~70 ms in the gateway
(every stream stops), more as requests' objects add up. `gc.freeze()` moves what exists into a
permanent generation the collector skips, as vLLM does after its startup. Called once by each
command that serves, after loading and before the first request; never by library code, so a
test process (or anything embedding the engine) keeps its own collector settings.

The same commands set the collector's thresholds: `CORRAL_GC_THRESHOLDS` (one to three
comma-separated non-negative integers, as `gc.set_threshold` takes them), else
SERVING_THRESHOLDS. A bad value stops the command before it loads anything.
"""

from __future__ import annotations

import gc
import os

THRESHOLDS_ENV = "CORRAL_GC_THRESHOLDS"
SERVING_COMMANDS = frozenset({"engine", "gateway", "up"})
# Python's own are (700, 10, 10). A full pass waits for 100 passes of generation 1 instead of 10
# (and, as always, for a quarter of the long-lived heap to be new): with 3,000 requests at once a
# simulated engine made no full pass instead of six, its collector took 0.3 s instead of 1.5 and
# its CPU a token 0.76-0.80x, at the same peak RSS (docs/engine-speed.md, "The collector's
# thresholds").
SERVING_THRESHOLDS: tuple[int, ...] = (700, 10, 100)


class ThresholdSettingError(ValueError):
    """CORRAL_GC_THRESHOLDS is not one to three non-negative integers."""


def parse_thresholds(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    if not 1 <= len(parts) <= 3 or not all(part.isascii() and part.isdigit() for part in parts):
        raise ThresholdSettingError(
            f"{THRESHOLDS_ENV}={text!r}: expected one to three comma-separated non-negative "
            "integers (generation 0's allocations, then generations 1 and 2's counts), e.g. 700,10,10"
        )
    return tuple(int(part) for part in parts)


def serving_thresholds() -> tuple[int, ...]:
    """The thresholds a serving command sets: the environment's, else SERVING_THRESHOLDS."""
    text = os.environ.get(THRESHOLDS_ENV, "").strip()
    return parse_thresholds(text) if text else SERVING_THRESHOLDS


def freeze_startup_heap() -> None:
    """Collect what startup left as garbage, freeze the rest and set the serving thresholds
    (once per process)."""
    if gc.get_freeze_count():
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*serving_thresholds())
