"""`corral bench --endpoint-type chat --random-images N` against a real engine serving the demo
LLaVA: every request succeeds, and the input tokens it reports are the server's, images included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from corral_engine.demo_llava import write_llava_model
from corral_engine.wire import PROMPT_TOKENS_TOTAL

from e2e.procs import start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_IMAGE_TOKENS = 16  # the demo's 32x32 input in 8x8 patches, whatever the image's own size


def test_each_request_sends_its_images_and_counts_their_tokens(tmp_path: Path):
    model = write_llava_model(tmp_path / "llava")
    result_file = tmp_path / "result.json"
    with start_engine(model, max_model_len=256) as engine:
        before = engine.metric(PROMPT_TOKENS_TOTAL)
        cmd = [
            sys.executable, "-m", "corral_cli.main", "bench", "--no-progress", "--base-url", engine.url,
            "--endpoint-type", "chat", "--random-images", "2", "--random-image-size", "48x40",
            "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3", "--ignore-eos",
            "--result-file", str(result_file),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        served = engine.metric(PROMPT_TOKENS_TOTAL) - before
    doc = json.loads(result_file.read_text())
    assert (doc["benchmark"]["random_images"], doc["benchmark"]["random_image_size"]) == (2, "48x40")
    (run,) = doc["runs"]
    assert (run["completed"], run["failed"], run["total_output_tokens"]) == (4, 0, 12)
    assert run["total_input_tokens"] == served >= 4 * 2 * NUM_IMAGE_TOKENS
