# syntax=docker/dockerfile:1
# The bundled inference engine, CPU build. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t ghcr.io/corral-dev/corral-engine:0.1.0-cpu .
# PyPI's default torch wheel also carries CUDA; for a smaller CPU-only image point TORCH_INDEX_URL at
# PyTorch's CPU wheel index: --build-arg TORCH_INDEX_URL=<index url>.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/corral
ENV PATH=/opt/corral/bin:$PATH
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" "torch>=2.6,<2.16"; fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY gateway gateway
COPY operator operator
COPY cli cli
RUN pip install ".[engine,tracing]"

FROM python:${PYTHON_VERSION}-slim
# A C compiler for the native paged-attention kernel, built for the node's own CPU at first start
# (cached under $HOME/.cache/corral/kernels); without one the engine falls back to PyTorch SDPA.
# tcmalloc, preloaded below: 6-10% more batched throughput on CPU than glibc's malloc
# (docs/engine-speed.md); linked to one path whatever the architecture's library directory.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libtcmalloc-minimal4 \
    && ln -s "$(find /usr/lib -name libtcmalloc_minimal.so.4 | head -n 1)" /usr/local/lib/libtcmalloc_minimal.so.4 \
    && rm -rf /var/lib/apt/lists/*
ENV LD_PRELOAD=/usr/local/lib/libtcmalloc_minimal.so.4 TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=1099511627776
# Tensors of 2 MiB+ on transparent huge pages (PyTorch's switch; docs/engine-speed.md, item 12).
ENV THP_MEM_ALLOC_ENABLE=1
RUN groupadd --gid 10001 corral \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin corral
COPY --from=build /opt/corral /opt/corral
# Weights come from the mounted model directory only; nothing is fetched from a model hub at run time.
ENV PATH=/opt/corral/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
USER 10001
EXPOSE 8000
ENTRYPOINT ["corral"]
CMD ["engine", "--model", "/models", "--host", "0.0.0.0", "--port", "8000"]
