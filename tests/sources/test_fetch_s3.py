"""s3:// through boto3 against a moto S3 server on loopback with request signing enforced: download
and verification, a complete entry served from the cache, and each failure's exit code, with the
keys never in the output."""

from __future__ import annotations

from pathlib import Path

import pytest
from corral_engine.settings import SourceSettings
from corral_engine.sources import FetchError, FetchOptions, parse, resolve_model
from corral_engine.sources.cache import COMPLETE_MARKER

from tests.sources.conftest import BUCKET, PREFIX, clean_env, fetch_model, small_tmpfs
from tests.sources.s3_server import S3Server

URI = f"s3://{BUCKET}/{PREFIX}"


def test_fetch_then_the_cache_answers_without_the_store(
    s3: S3Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    options = FetchOptions(cache_dir=tmp_path, show_progress=False)
    first = resolve_model(parse(URI), SourceSettings(**s3.env()), options)
    assert first.was_downloaded and (first.path / COMPLETE_MARKER).is_file()
    for source in tiny_model_dir.iterdir():
        assert (first.path / source.name).read_bytes() == source.read_bytes()
    # Complete: the store is not asked again (these keys would be refused).
    refused = SourceSettings(**{**s3.env(), "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    again = resolve_model(parse(URI), refused, options)
    assert (again.path, again.was_downloaded) == (first.path, False)


@pytest.mark.parametrize(
    ("uri", "override", "exit_code", "reason"),
    [
        (URI, {}, 0, None),
        (f"s3://{BUCKET}/no/such/prefix", {}, 3, "ModelNotFound"),
        ("s3://no-such-bucket/x", {}, 3, "ModelNotFound"),
        (URI, {"AWS_SECRET_ACCESS_KEY": "wrongSecretKey/abcdefghijklmnop"}, 4, "ModelUnauthorized"),
        (URI, {"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000"}, 4, "ModelUnauthorized"),
    ],
)
def test_cli_exit_codes_messages_and_no_secrets(
    s3: S3Server, tmp_path: Path, uri: str, override: dict[str, str], exit_code: int, reason: str | None
) -> None:
    env = clean_env(tmp_path, **{**s3.env(), **override})
    endpoint = env.pop("AWS_ENDPOINT_URL")  # given by the flag instead
    done = fetch_model(uri, "--cache-dir", str(tmp_path / "c"), "--s3-endpoint", endpoint, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == exit_code, output
    assert "Traceback" not in output
    assert env["AWS_SECRET_ACCESS_KEY"] not in output
    if reason is None:
        path = Path(done.stdout.splitlines()[-1])
        assert path.parent.parent.parent == tmp_path / "c" / "s3" / endpoint.split("//")[1].replace(":", "_")
        assert (path / COMPLETE_MARKER).is_file()
    else:
        errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and reason in errors[0], output


def test_a_full_disk_is_reported_as_such(s3: S3Server, tmp_path: Path) -> None:
    cache = tmp_path / "small"
    done = fetch_model(
        URI, "--cache-dir", str(cache), env=clean_env(tmp_path, **s3.env()), prefix=small_tmpfs(cache)
    )
    assert done.returncode == 5, done.stderr
    assert "DiskFull" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("uri", "override"),
    [
        (f"s3://{BUCKET}/no/such/prefix", {}),
        (URI, {"AWS_SECRET_ACCESS_KEY": "wrongSecretKey/abcdefghijklmnop"}),
    ],
)
def test_a_failed_fetch_leaves_no_model_folders_in_the_cache(
    s3: S3Server, tmp_path: Path, uri: str, override: dict[str, str]
) -> None:
    cache = tmp_path / "cache"
    options = FetchOptions(cache_dir=cache, show_progress=False)
    with pytest.raises(FetchError):
        resolve_model(parse(uri), SourceSettings(**{**s3.env(), **override}), options)
    assert [p.name for p in cache.iterdir()] == [".locks"]  # its lock file only


def test_pickled_weights_are_fetched_only_without_safetensors(
    s3: S3Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.engine.test_pickled_weights import pickled_copy

    only_bin = pickled_copy(tiny_model_dir, tmp_path / "bin")
    s3.upload_dir(BUCKET, "pickled/bin", only_bin)
    (only_bin / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
    s3.upload_dir(BUCKET, "pickled/both", only_bin)
    options = FetchOptions(cache_dir=tmp_path / "cache", show_progress=False)
    got = resolve_model(parse(f"s3://{BUCKET}/pickled/bin"), SourceSettings(**s3.env()), options).path
    assert (got / "pytorch_model.bin").is_file() and not (got / "model.safetensors").exists()
    got = resolve_model(parse(f"s3://{BUCKET}/pickled/both"), SourceSettings(**s3.env()), options).path
    assert (got / "model.safetensors").is_file() and not (got / "pytorch_model.bin").exists()
