"""Embedding models through the gateway: the official openai client's `embeddings.create` to two real
engine replicas of a BERT-family encoder (--runner auto serves it with pooling), beside a chat model
in the same gateway, each request routed by its `model`; and `corral up -f examples/embeddings.yaml`."""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from corral_engine.demo_encoder import write_demo_encoder

from e2e.gateway.conftest import start_gateway, wait_for
from e2e.procs import EngineProcess, ManagedProcess, free_port

pytestmark = pytest.mark.e2e

EMBED, CHAT = "embed", "chat"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embeddings.yaml"
TEXTS = ["hello world", "embeddings for retrieval", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def fleet(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ManagedProcess, list[EngineProcess]]]:
    """Two encoder replicas and one chat replica (started together), behind one gateway."""
    root = tmp_path_factory.mktemp("embed-fleet")
    encoder = write_demo_encoder(root / "bert", arch="bert")
    specs = [(encoder, EMBED), (encoder, EMBED), (tiny_model_dir, CHAT)]
    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(EngineProcess(d, free_port(), {"served_model_name": name}, log_dir=root))
            for d, name in specs
        ]
        for engine in engines:
            engine.wait_ready()
        backends = {EMBED: [e.url for e in engines[:2]], CHAT: [engines[2].url]}
        gateway = stack.enter_context(start_gateway(backends, root))
        yield gateway, engines


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_embeddings_through_the_gateway_equal_each_replicas_own(
    fleet: tuple[ManagedProcess, list[EngineProcess]],
) -> None:
    gateway, engines = fleet
    via_gw = _client(gateway.url).embeddings.create(model=EMBED, input=TEXTS)  # base64, decoded
    assert [d.index for d in via_gw.data] == [0, 1, 2] and via_gw.model == EMBED
    assert via_gw.usage.prompt_tokens == via_gw.usage.total_tokens > len(TEXTS)
    for engine in engines[:2]:  # the same weights: either replica's vectors
        direct = _client(engine.url).embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
        for a, b in zip(via_gw.data, direct.data, strict=True):
            assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
    assert all(math.isclose(math.hypot(*d.embedding), 1.0, abs_tol=1e-4) for d in via_gw.data)
    ids = _client(gateway.url).embeddings.create(model=EMBED, input=[[2, 10, 20, 3]])
    assert len(ids.data[0].embedding) == len(via_gw.data[0].embedding)


def test_a_chat_model_beside_it_is_routed_by_model(fleet: tuple[ManagedProcess, list[EngineProcess]]) -> None:
    gateway, _ = fleet
    client = _client(gateway.url)
    assert sorted(m.id for m in client.models.list().data) == [CHAT, EMBED]
    chat = client.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.choices[0].message.content and chat.usage is not None
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.embeddings.create(model=CHAT, input="hi")


def test_corral_up_serves_the_embeddings_example(tmp_path: Path) -> None:
    """`corral up -f examples/embeddings.yaml --model-path DIR` with the demo BERT: its two replicas
    serve /v1/embeddings behind the gateway, under the served name and its alias."""
    model_dir = write_demo_encoder(tmp_path / "bert", arch="bert")
    port = free_port()
    log_path = tmp_path / "up.log"
    argv = [sys.executable, "-m", "corral_cli.main", "up", "-f", str(EXAMPLE), "--model-path", str(model_dir)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*argv, "--port", str(port), "--log-dir", str(tmp_path)], stdout=log, stderr=log
        )
    try:
        wait_for("the banner", lambda: "Corral is up" in log_path.read_text(errors="replace"), timeout_s=300)
        assert f"curl http://127.0.0.1:{port}/v1/embeddings" in log_path.read_text()
        client = _client(f"http://127.0.0.1:{port}")
        for name in ("BAAI/bge-base-en-v1.5", "bge"):
            reply = client.embeddings.create(model=name, input=TEXTS)
            assert len(reply.data) == len(TEXTS) and reply.model == "BAAI/bge-base-en-v1.5"
        replicas = httpx.get(f"http://127.0.0.1:{port}/corral/replicas").json()["models"]
        assert [len(r) for r in replicas.values()] == [2]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(90) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
