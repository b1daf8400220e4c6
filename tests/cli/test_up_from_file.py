"""`corral up -f`: the same LLMDeployment YAML as on a cluster becomes local engine flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from corral_cli import cmd_up, listen, local_engines, up_banner
from corral_cli.cmd_engine import add_arguments as add_engine_arguments
from corral_cli.cmd_engine import engine_args_from

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_example_becomes_one_flag_list_per_replica() -> None:
    fleet = cmd_up._fleet(_args("-f", str(EXAMPLE), "--model-path", "/models/x"))
    assert list(fleet) == ["tiny-llama"]
    (replicas,) = fleet.values()
    assert len(replicas) == 2
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    engine_args = engine_args_from(parser.parse_args(replicas[0]))
    assert engine_args.model == "/models/x"
    assert engine_args.served_model_name == "tiny-llama"
    assert engine_args.max_num_seqs == 32 and engine_args.dtype == "float32"


def test_engines_of_a_local_fleet_share_the_card() -> None:
    """--gpu-memory-utilization is each engine's own share (vLLM's meaning), and a local fleet's
    engines all land on one GPU: each gets an even part of the default, unless its flags set one."""
    fleet = cmd_up._fleet(_args("-f", str(EXAMPLE), "--model-path", "/models/x"))
    for flags in fleet["tiny-llama"]:
        assert flags[-2:] == ["--gpu-memory-utilization", "0.45"]
    fleet = {"a": [["--model", "x"]], "b": [["--gpu-memory-utilization=0.3"], ["--model", "y"]]}
    assert cmd_up._share_the_card(fleet) == {
        "a": [["--model", "x", "--gpu-memory-utilization", "0.3"]],
        "b": [["--gpu-memory-utilization=0.3"], ["--model", "y", "--gpu-memory-utilization", "0.3"]],
    }
    one = {"a": [["--model", "x"]]}
    assert cmd_up._share_the_card(one) == one
    many = {"a": [["--model", "x"]] * 30}
    assert cmd_up._share_the_card(many)["a"][0][-1] == "0.05"  # the flag's floor


def test_non_corral_engine_is_refused(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("kind: corral\n", "kind: vllm\n")
    text = text.replace("      kvPolicy: preempt\n", "")  # a corral-only option
    path = tmp_path / "vllm.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="cannot run locally"):
        cmd_up._fleet(_args("-f", str(path)))


def test_up_simulate_runs_every_replica_in_one_engine_process(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--simulate", "h100-llama3-8b", "--replicas", "16"])
    fleet = cmd_up._fleet(args)
    [(name, [flags])] = fleet.items()
    assert flags[-2:] == ["--simulate", "h100-llama3-8b"] and name == tmp_path.name
    ports = listen.free_ports("127.0.0.1", 16)
    assert ports == list(range(ports[0], ports[0] + 16))


def test_engines_listen_below_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine binds its port after loading its model: an ephemeral port could meanwhile be taken
    by an outgoing connection (another engine's gloo connections, a health poll)."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    monkeypatch.setattr(cmd_up.subprocess, "Popen", lambda *args, **kwargs: None)
    for _ in range(20):
        engine = local_engines.LocalEngine(["--model", str(tmp_path)], 1, tmp_path, [], num_replicas=4)
        ports = [int(url.rsplit(":", 1)[1]) for url in engine.urls]
        assert ports == list(range(engine.port, engine.port + 4)) and ports[-1] < first_ephemeral


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-f", str(EXAMPLE), "--model-path", "/models/x", "--replicas", "1"], "--replicas"),
        (
            ["-f", str(EXAMPLE), "--model-path", "/models/x", "--served-model-name", "foo"],
            "--served-model-name",
        ),
        (["--demo", "--model-path", "/models/x"], "--model-path"),
        (["-f", str(EXAMPLE), "--model-path", "/models/x", "--demo-preset", "small"], "--demo-preset"),
        (["--model", "/models/x", "--demo-preset", "small"], "--demo-preset"),
    ],
)
def test_flags_the_file_would_overrule_are_refused(argv: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        cmd_up._fleet(_args(*argv))


@pytest.mark.parametrize("source", ["--model", "--model-path"])
def test_a_missing_model_directory_is_refused_before_any_engine_starts(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_engine(*_: object, **__: object) -> None:
        raise AssertionError("an engine was started")

    monkeypatch.setattr(cmd_up, "LocalEngine", no_engine)
    missing = tmp_path / "missing"
    from_file = ["-f", str(EXAMPLE), "--model-path", str(missing)]
    args = _args(*(["--model", str(missing)] if source == "--model" else from_file))
    args.log_level, args.log_format = "INFO", "text"
    assert cmd_up.run(args) == 3  # fetch-model's "not found" code, as `corral engine` exits with
    assert f"model directory '{missing}' does not exist" in caplog.text


def test_a_model_on_s3_is_fetched_from_the_files_endpoint(tmp_path: Path) -> None:
    """spec.model.s3Endpoint reaches each local engine, which fetches the model itself (as a pod's
    init container does); a model elsewhere gets no such flag."""
    text = EXAMPLE.read_text()
    source = "    source:\n      hostPath:\n        path: /var/lib/corral/models/tiny-llama\n"
    doc = text.replace(source, "    uri: s3://bucket/tiny\n    s3Endpoint: http://127.0.0.1:9000\n")
    assert doc != text
    path = tmp_path / "s3.yaml"
    path.write_text(doc)
    (flags, *_) = cmd_up._fleet(_args("-f", str(path)))["tiny-llama"]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    parsed = parser.parse_args(flags)
    assert parsed.model == "s3://bucket/tiny" and parsed.s3_endpoint == "http://127.0.0.1:9000"
    (plain, *_) = cmd_up._fleet(_args("-f", str(EXAMPLE), "--model-path", "/models/x"))["tiny-llama"]
    assert "--s3-endpoint" not in plain


def test_the_embeddings_example_serves_with_the_pooling_runner(tmp_path: Path) -> None:
    """examples/embeddings.yaml: its replicas get --runner pooling, and the banner shows
    /v1/embeddings (its chat route would answer 400)."""
    example = EXAMPLE.parent / "embeddings.yaml"
    fleet = cmd_up._fleet(_args("-f", str(example), "--model-path", str(tmp_path)))
    [(name, replicas)] = fleet.items()
    assert name == "BAAI/bge-base-en-v1.5" and len(replicas) == 2
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    engine_args = engine_args_from(parser.parse_args(replicas[0]))
    assert engine_args.runner == "pooling" and engine_args.max_model_len == 512
    assert up_banner.fleet_kind(replicas[0]) == "embeddings"
    banner = up_banner.usage_text("http://127.0.0.1:9000", name, up_banner.fleet_kind(replicas[0]))
    assert "curl http://127.0.0.1:9000/v1/embeddings" in banner and "chat/completions" not in banner


@pytest.mark.parametrize(
    ("architecture", "kind"),
    [
        ("BertModel", "embeddings"),
        ("Qwen3Model", "embeddings"),
        ("BertForMaskedLM", "embeddings"),  # an encoder: the engine pools it under auto
        ("XLMRobertaForSequenceClassification", "rerank"),
        ("BertForSequenceClassification:3", "classify"),  # three labels: no scores, /classify
        ("BertForTokenClassification:5", "token-classify"),  # labels a token: /pooling
        ("LlamaForCausalLM", "chat"),
        ("LlavaForConditionalGeneration", "vision"),  # chat, with an image in the example
    ],
)
def test_the_banner_follows_what_runner_auto_serves(tmp_path: Path, architecture: str, kind: str) -> None:
    architecture, _, labels = architecture.partition(":")
    id2label = {str(i): f"LABEL_{i}" for i in range(int(labels or 1))}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], "id2label": id2label}))
    assert up_banner.fleet_kind(["--model", str(tmp_path)]) == kind
    banner = up_banner.usage_text(
        "http://127.0.0.1:9000", "m", up_banner.fleet_kind(["--model", str(tmp_path)])
    )
    route = {
        "embeddings": "/v1/embeddings",
        "rerank": "/v1/rerank",
        "classify": "/classify",
        "token-classify": "/pooling",
        "chat": "/v1/chat/completions",
        "vision": "/v1/chat/completions",
    }[kind]
    assert f"curl http://127.0.0.1:9000{route}" in banner


def test_the_banner_shows_chat_without_a_readable_checkpoint(tmp_path: Path) -> None:
    assert up_banner.fleet_kind(["--model", str(tmp_path / "missing")]) == "chat"
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    assert up_banner.fleet_kind(["--model", str(tmp_path), "--runner", "generate"]) == "chat"
