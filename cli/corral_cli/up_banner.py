"""What `corral up` prints once its fleet serves: ready-to-paste curl and openai examples for its
first model's kind: a chat model, a vision-language one (an image in the chat), an embedding model
(/v1/embeddings), a reranker (/v1/rerank), a classifier of several labels (/classify) or a token
classifier (/pooling)."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any, Literal

FleetKind = Literal["chat", "vision", "embeddings", "rerank", "classify", "token-classify"]

# A 2x2 red PNG as a data: URL: the vision example works where the server reaches no web host.
_EXAMPLE_IMAGE_URL = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR42mO8IyfHwMDAxMDAwMDAAAAOCAEc4R2zdQAAAABJRU5ErkJggg=="
)


def usage_text(base_url: str, model: str, kind: FleetKind = "chat") -> str:
    """The ready-to-paste examples printed once the fleet is up, for a model of `kind` (a pooling
    model's chat route answers 400)."""
    if kind == "embeddings":
        return _embedding_usage_text(base_url, model)
    if kind == "rerank":
        return _rerank_usage_text(base_url, model)
    if kind == "classify":
        return _classify_usage_text(base_url, model)
    if kind == "vision":
        return _vision_usage_text(base_url, model)
    if kind == "token-classify":
        return _token_classify_usage_text(base_url, model)
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


def _vision_usage_text(base_url: str, model: str) -> str:
    content = [
        {"type": "text", "text": "What colour is this image?"},
        {"type": "image_url", "image_url": {"url": _EXAMPLE_IMAGE_URL}},
    ]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 32})
    return f"""
Corral is up: an OpenAI-compatible endpoint at {base_url}/v1 serving vision-language model "{model}".
Images go in chat messages as image_url parts: data: URLs, or http(s) URLs the engine fetches.

  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base_url}/v1", api_key="unused")
content = {json.dumps(content)}
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": content}}], max_tokens=32
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


def _rerank_usage_text(base_url: str, model: str) -> str:
    return f"""
Corral is up: an endpoint at {base_url} serving reranker "{model}" (vLLM's /v1/rerank and /v1/score).

  curl {base_url}/v1/rerank -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "query": "What is a panda?", "documents": ["A bear.", "A city."], "top_n": 1}}'

  curl {base_url}/v1/score -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "text_1": "What is a panda?", "text_2": ["A bear.", "A city."]}}'

Metrics: {base_url}/metrics   Replicas: {base_url}/corral/replicas   Stop: Ctrl-C
"""


def _classify_usage_text(base_url: str, model: str) -> str:
    return f"""
Corral is up: an endpoint at {base_url} serving classifier "{model}" (vLLM's /classify).

  curl {base_url}/classify -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "input": ["I loved it", "Not my thing"]}}'

Metrics: {base_url}/metrics   Replicas: {base_url}/corral/replicas   Stop: Ctrl-C
"""


def _token_classify_usage_text(base_url: str, model: str) -> str:
    return f"""
Corral is up: an endpoint at {base_url} serving token classifier "{model}" (vLLM's /pooling,
task token_classify: each token's label probabilities).

  curl {base_url}/pooling -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "input": "Ada Lovelace lived in London", "task": "token_classify"}}'

Metrics: {base_url}/metrics   Replicas: {base_url}/corral/replicas   Stop: Ctrl-C
"""


def fleet_kind(flags: list[str]) -> FleetKind:
    """What an engine of these flags serves: embeddings or scores under --runner pooling, or auto on a
    local checkpoint whose config.json names an embedding architecture or an encoder (BertModel,
    Qwen3Model, XLMRobertaForSequenceClassification, ...); a vision-language architecture's chat
    takes images; else chat."""
    from corral_engine.pooling import (
        choose_runner,
        is_classifier_architecture,
        is_token_classifier_architecture,
    )
    from corral_engine.vision_config import VISION_ARCHITECTURES

    from corral_cli.cmd_engine import add_arguments, engine_args_from

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    known, _ = parser.parse_known_args(flags)
    engine_args = engine_args_from(known)
    config_path = Path(engine_args.model) / "config.json"
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(config_path.read_text())
        config = loaded if isinstance(loaded, dict) else {}
    architectures = [str(a) for a in config.get("architectures") or []]
    if choose_runner(engine_args.runner, architectures) != "pooling":
        return "vision" if any(a in VISION_ARCHITECTURES for a in architectures) else "chat"
    if not any(is_classifier_architecture(a) for a in architectures):
        return "embeddings"
    if any(is_token_classifier_architecture(a) for a in architectures):
        return "token-classify"
    labels = config.get("id2label") or {}
    num_labels = config.get("num_labels", len(labels) if isinstance(labels, dict) else 1)
    return "rerank" if num_labels in (1, 0) else "classify"  # scores need one label
