# syntax=docker/dockerfile:1
# The OpenAI-compatible gateway (no torch). Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/corral-dev/corral-gateway:0.1.0 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/corral
ENV PATH=/opt/corral/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY gateway gateway
COPY operator operator
COPY cli cli
RUN pip install ".[gateway,tracing]"

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 10001 corral \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin corral
COPY --from=build /opt/corral /opt/corral
ENV PATH=/opt/corral/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001
EXPOSE 8000
ENTRYPOINT ["corral"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000", "--kubernetes"]
