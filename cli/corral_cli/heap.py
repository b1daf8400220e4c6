"""The serving processes' startup heap, kept out of the garbage collector's full passes.

Everything a server builds before it serves (torch, transformers, FastAPI, the model, the app:
~420,000 objects in an engine, ~63,000 in the gateway) stays alive until it exits, yet every pass
over the collector's oldest generation walks all of it, holding the GIL: on a 2-core AVX2 machine
~380 ms a pass in an engine (the step thread and the server both stop) and ~70 ms in the gateway
(every stream stops), more as requests' objects add up. `gc.freeze()` moves what exists into a
permanent generation the collector skips, as vLLM does after its startup. Called once by each
command that serves, after loading and before the first request; never by library code, so a
test process (or anything embedding the engine) keeps its own collector settings.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what startup left as garbage, then freeze the rest (once per process)."""
    if gc.get_freeze_count():
        return
    gc.collect()
    gc.freeze()
