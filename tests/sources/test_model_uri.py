"""Model URIs, cache entries and checkpoint checks (pure or on temporary directories)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
from corral_engine.settings import SourceSettings
from corral_engine.sources import FetchError, ModelUriError, parse, parse_model_uri, resolve_model
from corral_engine.sources.cache import (
    ExpectedFile,
    allow_patterns,
    entry_dir,
    verify_checkpoint,
    verify_files,
)
from corral_engine.sources.errors import disk_error


@pytest.mark.parametrize(
    ("text", "scheme", "location", "path", "revision", "name"),
    [
        ("hf://Qwen/Qwen3-8B", "hf", "Qwen/Qwen3-8B", "", None, "Qwen/Qwen3-8B"),
        ("hf://meta-llama/Llama-3.1-8B-Instruct@v1.0", "hf", "meta-llama/Llama-3.1-8B-Instruct", "", "v1.0",
         "meta-llama/Llama-3.1-8B-Instruct"),
        ("hf://gpt2", "hf", "gpt2", "", None, "gpt2"),
        ("s3://bucket/models/llama/", "s3", "bucket", "models/llama", None, "llama"),
        ("s3://bucket", "s3", "bucket", "", None, "bucket"),
        ("pvc://models-pvc/llama/8b", "pvc", "models-pvc", "llama/8b", None, "8b"),
        ("/models/tiny", "local", "/models/tiny", "", None, "tiny"),
        ("relative/dir", "local", "relative/dir", "", None, "dir"),
    ],
)  # fmt: skip
def test_parse(text: str, scheme: str, location: str, path: str, revision: str | None, name: str) -> None:
    uri = parse_model_uri(text)
    assert (uri.scheme, uri.location, uri.path, uri.revision) == (scheme, location, path, revision)
    assert uri.default_served_name == name
    assert uri.is_remote == (scheme in ("hf", "s3"))


@pytest.mark.parametrize(
    "text",
    ["", "gs://b/m", "hf://", "hf://a/b/c", "hf://org/../x", "hf://org/name@", "s3:///prefix",
     "s3://b/../../etc", "pvc://claim", "pvc://claim/./../x", "s3://b/p?versionId=1"],
)  # fmt: skip
def test_bad_uris_are_refused(text: str) -> None:
    with pytest.raises(ModelUriError):
        parse_model_uri(text)


def test_revision_flag() -> None:
    assert parse("hf://o/n", revision="v2").revision == "v2"
    assert parse("hf://o/n@v2", revision="v2").revision == "v2"
    for text, revision in (("hf://o/n@v1", "v2"), ("s3://b/p", "v2")):
        with pytest.raises(FetchError) as e:
            parse(text, revision)
        assert e.value.exit_code == 2


def test_cache_entries_keep_sources_apart(tmp_path: Path) -> None:
    assert entry_dir(tmp_path, parse_model_uri("hf://o/n@refs/pr/1")) == tmp_path / "hf/o/n/refs--pr--1"
    s3 = parse_model_uri("s3://b/p/q")
    assert entry_dir(tmp_path, s3) == tmp_path / "s3/aws/b/p/q"
    assert entry_dir(tmp_path, s3, "http://127.0.0.1:9000") == tmp_path / "s3/127.0.0.1_9000/b/p/q"


def test_pvc_resolves_under_the_mount_root(tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "claim" / "llama" / "tiny")
    settings = SourceSettings(CORRAL_PVC_ROOT=str(tmp_path))
    resolved = resolve_model(parse("pvc://claim/llama/tiny"), settings)
    assert (resolved.path, resolved.was_downloaded) == (tmp_path / "claim/llama/tiny", False)
    (resolved.path / "tokenizer.json").unlink()
    with pytest.raises(FetchError, match="tokenizer") as e:
        resolve_model(parse("pvc://claim/llama/tiny"), settings)
    assert e.value.reason == "ModelNotFound"


def test_a_lora_adapter_is_a_complete_checkpoint_of_its_own(tmp_path: Path) -> None:
    """PEFT's layout: adapter_config.json and adapter_model.safetensors, no tokenizer."""
    adapter = tmp_path / "claim" / "adapters" / "sql"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    settings = SourceSettings(CORRAL_PVC_ROOT=str(tmp_path))
    with pytest.raises(FetchError, match=r"not a complete LoRA adapter: no adapter_model\.safetensors"):
        resolve_model(parse("pvc://claim/adapters/sql"), settings)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    assert resolve_model(parse("pvc://claim/adapters/sql"), settings).path == adapter


def test_verify_files_checks_sizes_digests_and_shards(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    size = (model / "config.json").stat().st_size
    verify_files(model, [ExpectedFile("config.json", size_bytes=size)])
    for wrong in (ExpectedFile("config.json", size_bytes=size + 1), ExpectedFile("config.json", md5="0" * 32),
                  ExpectedFile("config.json", sha256="0" * 64)):  # fmt: skip
        with pytest.raises(FetchError) as e:
            verify_files(model, [wrong])
        assert e.value.exit_code == 6
        assert not (model / "config.json").exists()  # so the next try downloads it again
        shutil.copy(tiny_model_dir / "config.json", model / "config.json")
    with pytest.raises(FetchError, match="missing"):
        verify_files(model, [ExpectedFile("absent.json")])
    index = {"weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00001.safetensors").write_bytes(b"x")
    with pytest.raises(FetchError, match="model-00002"):
        verify_checkpoint(model)


def test_disk_errors_anywhere_in_the_chain() -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        full = disk_error(outer)
    assert full is not None and (full.kind, full.exit_code) == ("disk_full", 5)
    assert disk_error(OSError(errno.EACCES, "Permission denied")) is None


def test_settings_never_show_their_secrets() -> None:
    secrets = {
        "HF_TOKEN": "hf_secretValue123",
        "AWS_SECRET_ACCESS_KEY": "awsSecret/456",
        "AWS_SESSION_TOKEN": "tok789",
    }
    settings = SourceSettings(**secrets, AWS_ACCESS_KEY_ID="AKIAEXAMPLE")
    shown = f"{settings!r} {settings} {settings.model_dump()} {settings.model_dump_json()}"
    assert not any(value in shown for value in secrets.values())
    assert settings.hf_token is not None and settings.hf_token.get_secret_value() == "hf_secretValue123"


@pytest.mark.parametrize(
    ("names", "weights"),
    [
        (["config.json", "model.safetensors", "pytorch_model.bin"], ("*.safetensors",)),
        (
            ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"],
            ("pytorch_model*.bin", "adapter_model.bin"),
        ),
        (["adapter_config.json", "adapter_model.bin"], ("pytorch_model*.bin", "adapter_model.bin")),
        (["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"], ("*.safetensors",)),
        # Only the top level counts: safetensors in a subfolder (onnx/, openvino/) are not the weights.
        (
            ["config.json", "onnx/model.safetensors", "pytorch_model.bin"],
            ("pytorch_model*.bin", "adapter_model.bin"),
        ),
    ],
)
def test_the_weights_fetched_are_safetensors_else_pickles(names: list[str], weights: tuple[str, ...]) -> None:
    assert allow_patterns(names)[-len(weights) :] == list(weights)
    assert not any(p.endswith((".bin", ".safetensors")) for p in allow_patterns(names)[: -len(weights)])


def test_an_adapter_with_pickled_weights_is_complete(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(FetchError, match=r"not a complete LoRA adapter: no adapter_model\.safetensors"):
        verify_checkpoint(tmp_path)
    (tmp_path / "adapter_model.bin").write_bytes(b"x")
    verify_checkpoint(tmp_path)
