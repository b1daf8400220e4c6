"""What `corral up` prints once its fleet serves: ready-to-paste curl and openai examples, for a
chat model or, where the first model embeds, for /v1/embeddings."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path


def usage_text(base_url: str, model: str, is_embedding: bool = False) -> str:
    """The ready-to-paste examples printed once the fleet is up (`is_embedding`: for an embedding
    model, whose chat route answers 400)."""
    if is_embedding:
        return _embedding_usage_text(base_url, model)
    return f"""
Corral is up: an OpenAI-compatible endpoint at {base_url}/v1 serving model "{model}".

  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base_url}/v1", api_key="unused")
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32
)
print(reply.choices[0].message.content)
PY

Metrics: {base_url}/metrics   Replicas: {base_url}/corral/replicas   Stop: Ctrl-C
"""


def _embedding_usage_text(base_url: str, model: str) -> str:
    return f"""
Corral is up: an OpenAI-compatible endpoint at {base_url}/v1 serving embedding model "{model}".

  curl {base_url}/v1/embeddings -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "input": ["Hello!", "Good morning"]}}'

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base_url}/v1", api_key="unused")
reply = client.embeddings.create(model="{model}", input=["Hello!", "Good morning"])
print([len(item.embedding) for item in reply.data])
PY

Metrics: {base_url}/metrics   Replicas: {base_url}/corral/replicas   Stop: Ctrl-C
"""


def is_embedding_fleet(flags: list[str]) -> bool:
    """Whether an engine of these flags serves embeddings: --runner pooling, or auto on a local
    checkpoint whose config.json names an embedding architecture (BertModel, Qwen3Model, ...)."""
    from corral_engine.pooling import choose_runner

    from corral_cli.cmd_engine import add_arguments, engine_args_from

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    known, _ = parser.parse_known_args(flags)
    engine_args = engine_args_from(known)
    config_path = Path(engine_args.model) / "config.json"
    architectures: list[str] = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        architectures = [str(a) for a in json.loads(config_path.read_text()).get("architectures") or []]
    return choose_runner(engine_args.runner, architectures) == "pooling"
