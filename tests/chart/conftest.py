"""Chart test fixtures: the pinned helm binary (from the e2e toolchain cache) and a renderer."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "corral"
PROFILES = {
    "default": None,
    "production": CHART / "ci" / "production-values.yaml",
    "operator-only": CHART / "ci" / "operator-only-values.yaml",
    "openshift": CHART / "ci" / "openshift-values.yaml",
}
KUBERNETES_VERSION = "1.36.0"  # the e2e control plane's minor (e2e/k8s/versions.env)


class Helm:
    def __init__(self, binary: Path, home: Path) -> None:
        self.binary = binary
        self.home = home
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=120, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
        return result

    def template(
        self, values_file: Path | None = None, *extra: str, namespace: str = "corral-system"
    ) -> list[dict[str, Any]]:
        args = ["template", "corral", str(CHART), "--namespace", namespace, *extra]
        if values_file is not None:
            args += ["--values", str(values_file)]
        docs = yaml.safe_load_all(self.run(*args).stdout)
        return [d for d in docs if d]

    def render(self, values: dict[str, Any], *extra: str) -> list[dict[str, Any]]:
        """`helm template` with these values, from a file (--set can't give a null or a list of maps)."""
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=self.home) as values_file:
            yaml.safe_dump(values, values_file)
            values_file.flush()
            return self.template(Path(values_file.name), *extra)


def _find_helm() -> Path:
    if os.environ.get("CORRAL_HELM"):
        return Path(os.environ["CORRAL_HELM"])
    from e2e.k8s.toolchain import ToolchainUnavailable, ensure_toolchain

    try:
        return ensure_toolchain().binary("helm")  # the pinned helm v4, built once and cached
    except ToolchainUnavailable as exc:
        on_path = shutil.which("helm")
        if on_path is None:
            pytest.skip(f"no helm: {exc}")
        return Path(on_path)


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(_find_helm(), tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def rendered(helm: Helm) -> Callable[[str], list[dict[str, Any]]]:
    """profile name -> rendered objects (cached per session)."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def render(profile: str) -> list[dict[str, Any]]:
        if profile not in cache:
            cache[profile] = helm.template(PROFILES[profile])
        return cache[profile]

    return render


def find(objects: Sequence[dict[str, Any]], kind: str, name_part: str = "") -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and name_part in o["metadata"]["name"]]


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's prometheus package (scripts/install-system.sh)")
    return path
