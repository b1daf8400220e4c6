"""What a CPU engine loads: neither torch's compiler stack (torch._dynamo) nor triton, which only
the Triton backends use. Both once came in through the embedding's random init on the meta device
(PyTorch's Python reference for normal_), ~2 s of every engine's start and triton's nanobind
"leaked" lines at every exit. Checked in a fresh interpreter: this one has imported everything."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = """
import json, sys
from corral_engine import EngineArgs, LLMEngine, SamplingParams
engine = LLMEngine(EngineArgs(model=sys.argv[1], num_kv_blocks=64))
engine.add_request("r", "hello", SamplingParams(max_tokens=2, temperature=0.0))
while engine.has_unfinished_requests():
    engine.step()
print(json.dumps({name: name in sys.modules for name in ("torch._dynamo", "triton")}))
"""


def test_a_cpu_engine_imports_no_dynamo_and_no_triton(tiny_model_dir: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CORRAL_TRITON_OPS")}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"torch._dynamo": False, "triton": False}
