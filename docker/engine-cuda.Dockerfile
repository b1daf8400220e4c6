# syntax=docker/dockerfile:1
# The bundled inference engine for NVIDIA GPUs. Build from the repository root:
#   docker build -f docker/engine-cuda.Dockerfile -t ghcr.io/corral-dev/corral-engine:0.1.0 .
# PyPI's torch wheels bring their own CUDA libraries; the base image adds the CUDA runtime user-space
# pieces, and the host's driver comes in through the NVIDIA container toolkit.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/corral
ENV PATH=/opt/corral/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY gateway gateway
COPY operator operator
COPY cli cli
RUN pip install ".[engine,tracing]"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 corral \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin corral
COPY --from=build /opt/corral /opt/corral
ENV PATH=/opt/corral/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001
EXPOSE 8000
ENTRYPOINT ["corral"]
CMD ["engine", "--model", "/models", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]
