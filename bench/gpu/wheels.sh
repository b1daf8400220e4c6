#!/usr/bin/env bash
# The wheels the GPU machine lacks for Corral's engine (python3.12, x86-64, no registry there):
# pydantic and pydantic-settings (EngineSettings) and what they need; and for the served engine
# (`corral engine`, bench/gpu/serve_layout.sh) FastAPI, Starlette, uvicorn, httptools and
# opentelemetry-api, with anyio and sniffio at the versions Starlette wants. Everything else the
# engine, bench/gpu and serve_ab's client import (torch, triton, transformers, tokenizers,
# safetensors, numpy, jinja2, matplotlib, rich, aiohttp, uvloop, httpx, prometheus-client,
# huggingface_hub, pyyaml, and peft for the lora phase's reference) is in that image (its package list: the device tool's KINDS.md). Downloads into .whl/ at the repo root, which git ignores
# through .git/info/exclude; the device call carries it (carry: [".whl"]) and installs it with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# Versions: this repo's .venv at the time of writing; pydantic pins pydantic-core exactly, and needs
# typing-extensions >= 4.16, newer than the image may hold.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEELS=(
    pydantic==2.14.4
    pydantic-core==2.50.5
    pydantic-settings==2.16.3
    python-dotenv==1.2.4
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    fastapi==0.165.0
    starlette==1.10.0
    uvicorn==0.54.0
    httptools==0.9.0
    opentelemetry-api==1.45.2
    annotated-doc==0.0.7
    anyio==4.16.0
    sniffio==1.3.1
)
mkdir -p .git/info
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl  # one version of each: two stop the install there
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -1 .whl
du -sh .whl
