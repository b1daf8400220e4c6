"""hf:// through huggingface_hub against the Hub stand-in on loopback: download, verification, the
cache (a complete entry needs no network; two processes download once), and each failure's exit
code and one-line message, with the token never in the output."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from corral_engine.settings import SourceSettings
from corral_engine.sources import FetchError, FetchOptions, parse, resolve_model
from corral_engine.sources.cache import COMPLETE_MARKER, discard_failed
from corral_engine.sources.progress import PROGRESS_EVENT

from tests.sources.conftest import HF_TOKEN, HF_TOKEN_NO_ACCESS, clean_env, fetch_model, small_tmpfs
from tests.sources.hub_standin import COMMIT, HubStandIn, Repo


def settings(hub: HubStandIn, **extra: str) -> SourceSettings:
    return SourceSettings(HF_ENDPOINT=hub.url, **extra)


def test_fetch_verifies_marks_complete_and_then_needs_no_network(
    hub: HubStandIn, tiny_model_dir: Path, tmp_path: Path
) -> None:
    options = FetchOptions(cache_dir=tmp_path, show_progress=False)
    gets_before = hub.file_gets("model.safetensors")
    first = resolve_model(parse("hf://org/tiny"), settings(hub), options)
    assert first.was_downloaded and first.path == tmp_path / "hf" / "org" / "tiny" / "main"
    for source in tiny_model_dir.iterdir():
        assert (first.path / source.name).read_bytes() == source.read_bytes()
    marker = json.loads((first.path / COMPLETE_MARKER).read_text())
    assert marker["commit"] == COMMIT and marker["uri"] == "hf://org/tiny"
    assert hub.file_gets("model.safetensors") == gets_before + 1
    assert sorted(p.name for p in first.path.parent.iterdir()) == ["main"]  # the lock is under .locks/

    # Complete in the cache: no request at all, even to a Hub that is not there.
    num_requests = sum(hub.requests.values())
    offline = SourceSettings(HF_ENDPOINT="http://127.0.0.1:9")
    again = resolve_model(parse("hf://org/tiny"), offline, options)
    assert (again.path, again.was_downloaded) == (first.path, False)
    assert sum(hub.requests.values()) == num_requests


def test_revision_from_the_uri_or_the_flag(hub: HubStandIn, tmp_path: Path) -> None:
    options = FetchOptions(cache_dir=tmp_path, show_progress=False)
    pinned = resolve_model(parse("hf://org/tiny", revision=COMMIT), settings(hub), options)
    assert pinned.path.name == COMMIT
    assert resolve_model(parse(f"hf://org/tiny@{COMMIT}"), settings(hub), options).path == pinned.path
    with pytest.raises(FetchError) as e:
        resolve_model(parse("hf://org/tiny@v9"), settings(hub), options)
    assert e.value.kind == "not_found" and e.value.exit_code == 3
    assert not (tmp_path / "hf" / "org" / "tiny" / "v9").exists()  # no empty entry left behind


@pytest.mark.parametrize("is_cache_new", [True, False])
@pytest.mark.parametrize(
    ("uri", "endpoint"),
    [
        ("hf://org/missing", None),  # 404
        ("hf://org/private", None),  # 401
        ("hf://org/tiny@v9", None),  # no such revision
        ("hf://org/tiny", "http://127.0.0.1:9"),  # nothing listening
    ],
)
def test_a_failed_fetch_leaves_the_cache_as_it_found_it(
    hub: HubStandIn, tmp_path: Path, uri: str, endpoint: str | None, is_cache_new: bool
) -> None:
    """No entry directory and no parent directories left behind (lock files live under .locks/)."""
    cache = tmp_path / "cache"
    if not is_cache_new:
        (cache / "hf" / "org" / "other" / "main").mkdir(parents=True)
        (cache / "hf" / "org" / "other" / "main" / "config.json").write_text("{}")

    def model_tree() -> list[Path]:
        return sorted(p for p in cache.rglob("*") if ".locks" not in p.relative_to(cache).parts)

    before = model_tree()
    options = FetchOptions(cache_dir=cache, show_progress=False)
    source = SourceSettings(HF_ENDPOINT=endpoint) if endpoint else settings(hub)
    with pytest.raises(FetchError):
        resolve_model(parse(uri), source, options)
    assert model_tree() == before


def test_a_failed_download_keeps_what_arrived_for_the_next_try(tmp_path: Path) -> None:
    """Bookkeeping alone (huggingface_hub's metadata, an empty partial file) is discarded; checkpoint
    bytes, whole or partial, stay so that the next fetch resumes."""
    client_state = tmp_path / "entry" / ".cache" / "huggingface" / "download"
    client_state.mkdir(parents=True)
    (client_state / "config.json.metadata").write_text("0123\netag\n1.0\n")
    (client_state / "x.etag.incomplete").write_bytes(b"")
    discard_failed(tmp_path / "entry")
    assert not (tmp_path / "entry").exists()

    for arrived in (".cache/huggingface/download/x.etag.incomplete", "config.json"):
        entry = tmp_path / arrived.replace("/", "_")
        (entry / arrived).parent.mkdir(parents=True)
        (entry / arrived).write_bytes(b"{")
        discard_failed(entry)
        assert (entry / arrived).read_bytes() == b"{"


@pytest.mark.parametrize(
    ("uri", "token", "exit_code", "reason"),
    [
        ("hf://org/missing", None, 3, "ModelNotFound"),
        ("hf://org/private", None, 4, "ModelUnauthorized"),
        ("hf://org/private", "hf_wrongToken000000000000", 4, "ModelUnauthorized"),
        ("hf://org/private", HF_TOKEN_NO_ACCESS, 4, "ModelUnauthorized"),
        ("hf://org/private", HF_TOKEN, 0, None),
        ("gs://bucket/model", None, 2, "InvalidModelURI"),
    ],
)
def test_cli_exit_codes_messages_and_no_secrets(
    hub: HubStandIn, tmp_path: Path, uri: str, token: str | None, exit_code: int, reason: str | None
) -> None:
    env = clean_env(tmp_path, HF_ENDPOINT=hub.url, **({"HF_TOKEN": token} if token else {}))
    done = fetch_model(uri, "--cache-dir", str(tmp_path / "cache"), env=env)
    output = done.stdout + done.stderr
    assert done.returncode == exit_code, output
    assert "Traceback" not in output
    if token:
        assert token not in output
    if reason is None:
        path = Path(done.stdout.splitlines()[-1])
        assert path == tmp_path / "cache" / "hf" / "org" / "private" / "main"
        assert (path / COMPLETE_MARKER).is_file()
        assert any(h.get("authorization") == f"Bearer {token}" for h in hub.headers_seen)
    else:
        errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and reason in errors[0], output
        assert done.stdout == ""


def test_progress_is_a_json_line_on_stderr_when_not_a_terminal(hub: HubStandIn, tmp_path: Path) -> None:
    env = clean_env(tmp_path, HF_ENDPOINT=hub.url)
    done = fetch_model("hf://org/tiny", "--cache-dir", str(tmp_path / "cache"), env=env)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if PROGRESS_EVENT in line]
    assert events and events[-1]["done"] is True
    assert events[-1]["downloaded_bytes"] == events[-1]["total_bytes"] > 0


def test_two_processes_sharing_a_cache_download_once(hub: HubStandIn, tmp_path: Path) -> None:
    env = clean_env(tmp_path, HF_ENDPOINT=hub.url, HF_TOKEN=HF_TOKEN)
    cache = tmp_path / "shared-pvc"
    before = hub.file_gets("model.safetensors")
    hub.chunk_delay_s = 0.05  # ~0.7 s for the weights, so the second process arrives mid-download
    try:
        argv = ["hf://org/private", "--cache-dir", str(cache)]
        procs = [_start_fetch(argv, env) for _ in range(2)]
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        hub.chunk_delay_s = 0.0
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0].splitlines()[-1] == outputs[1][0].splitlines()[-1]
    assert hub.file_gets("model.safetensors") == before + 1
    assert any("another process is fetching" in err for _, err in outputs)
    locks = [p.relative_to(cache).as_posix() for p in cache.rglob("*.lock") if ".cache" not in p.parts]
    assert locks == [".locks/hf--org--private--main.lock"]  # not beside the entry; not the client's own


def test_a_full_disk_is_reported_as_such(hub: HubStandIn, tmp_path: Path) -> None:
    """The cache on a 256 KiB tmpfs (mounted in a private mount namespace) cannot hold the weights."""
    cache = tmp_path / "small"
    env = clean_env(tmp_path, HF_ENDPOINT=hub.url)
    done = fetch_model("hf://org/tiny", "--cache-dir", str(cache), env=env, prefix=small_tmpfs(cache))
    assert done.returncode == 5, done.stderr
    assert "DiskFull" in done.stderr and "Traceback" not in done.stderr


def _start_fetch(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    import sys

    cmd = [sys.executable, "-m", "corral_cli.main", "fetch-model", *argv]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # the first takes the lock before the second starts
    return proc


def test_corral_up_fetches_once_and_hands_engines_the_directory(
    hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from corral_cli import cmd_up

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("CORRAL_MODEL_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    fleet = cmd_up._fleet(parser.parse_args(["--model", "hf://org/tiny", "--replicas", "2"]))
    entry = str(tmp_path / "hf" / "org" / "tiny" / "main")
    # Each of the two engines also gets half the card's default share (cmd_up._share_the_card).
    flags = ["--model", entry, "--served-model-name", "org/tiny", "--gpu-memory-utilization", "0.45"]
    assert fleet == {"org/tiny": [flags] * 2}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1"),
        ({"TRANSFORMERS_OFFLINE": "1"}, "HF_HUB_OFFLINE=1"),
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hub cannot be reached"),
    ],
)
def test_offline_or_unreachable_is_one_clear_line(
    tmp_path: Path, extra: dict[str, str], message: str
) -> None:
    done = fetch_model("hf://org/tiny", "--cache-dir", str(tmp_path), env=clean_env(tmp_path, **extra))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "FetchFailed" in errors[0] and message in errors[0], done.stderr


def test_the_offline_default_is_overridden_by_hf_hub_offline_0(hub: HubStandIn, tmp_path: Path) -> None:
    env = clean_env(tmp_path, HF_ENDPOINT=hub.url, TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="0")
    done = fetch_model("hf://org/tiny", "--cache-dir", str(tmp_path / "c"), env=env)
    assert done.returncode == 0, done.stderr


def test_a_damaged_entry_is_fetched_again(hub: HubStandIn, tmp_path: Path) -> None:
    options = FetchOptions(cache_dir=tmp_path, show_progress=False)
    first = resolve_model(parse("hf://org/tiny"), settings(hub), options)
    weights = first.path / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as fh:
        fh.truncate(size // 2)
    before = hub.file_gets("model.safetensors")
    again = resolve_model(parse("hf://org/tiny"), settings(hub), options)
    assert again.was_downloaded and weights.stat().st_size == size
    assert hub.file_gets("model.safetensors") == before + 1


def test_pickled_weights_are_fetched_only_without_safetensors(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A repo with only pytorch_model.bin is fetched and verified whole; one with both formats
    gets its safetensors and never its pickles (vLLM's --load-format auto)."""
    from tests.engine.test_pickled_weights import pickled_copy

    only_bin = pickled_copy(tiny_model_dir, tmp_path / "repos" / "bin")
    both = pickled_copy(tiny_model_dir, tmp_path / "repos" / "both")
    for file in tiny_model_dir.glob("*.safetensors"):
        (both / file.name).write_bytes(file.read_bytes())
    options = FetchOptions(cache_dir=tmp_path / "cache", show_progress=False)
    with HubStandIn({"org/bin": Repo(only_bin), "org/both": Repo(both)}) as hub:
        got = resolve_model(parse("hf://org/bin"), settings(hub), options).path
        assert (got / "pytorch_model.bin").read_bytes() == (only_bin / "pytorch_model.bin").read_bytes()
        got = resolve_model(parse("hf://org/both"), settings(hub), options).path
        assert (got / "model.safetensors").is_file() and not (got / "pytorch_model.bin").exists()
        assert hub.file_gets("pytorch_model.bin") == 1
