"""Fixtures for the model-source tests: the Hub stand-in and a moto S3 server on loopback, both
serving the tiny demo checkpoint, and `corral fetch-model` run as a real process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sources.hub_standin import HubStandIn, Repo
from tests.sources.s3_server import S3Server, moto_s3

HF_TOKEN = "hf_corralTestToken0123456789"
HF_TOKEN_NO_ACCESS = "hf_corralOtherToken987654321"
BUCKET, PREFIX = "models", "llama/tiny"
# Variables of the developer's shell that would change what the fetch does.
_SOURCE_ENV = (
    "HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "CORRAL_MODEL_CACHE",
    "CORRAL_PVC_ROOT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
    "AWS_PROFILE", "AWS_REGION",
)  # fmt: skip


@pytest.fixture(scope="session")
def hub(tiny_model_dir: Path) -> Iterator[HubStandIn]:
    repos = {
        "org/tiny": Repo(tiny_model_dir),
        "org/private": Repo(tiny_model_dir, tokens={HF_TOKEN: 200, HF_TOKEN_NO_ACCESS: 403}),
    }
    with HubStandIn(repos) as standin:
        yield standin


@pytest.fixture(scope="session")
def s3(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with moto_s3(tmp_path_factory.mktemp("moto-logs")) as server:
        server.upload_dir(BUCKET, PREFIX, tiny_model_dir)
        yield server


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without the sources' variables, HOME at `home`, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _SOURCE_ENV}
    return {**env, "HOME": str(home), "HF_HOME": str(home / "hf"), **extra}


def small_tmpfs(directory: Path) -> list[str]:
    """A command prefix that runs the command with a 256 KiB tmpfs on `directory`, mounted in a private
    mount namespace (nothing outside sees it; it goes when the command ends); skips where not allowed."""
    directory.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"'
    prefix = ["unshare", "--mount", "sh", "-c", script, str(directory)]
    if not shutil.which("unshare") or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here")
    return prefix


def fetch_model(
    *args: str, env: dict[str, str], prefix: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`corral --log-level DEBUG fetch-model ARGS` as a process; output captured."""
    argv = [*(prefix or []), sys.executable, "-m", "corral_cli.main", "--log-level", "DEBUG", "fetch-model"]
    return subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=120, check=False)
