"""Shared e2e fixtures: the real Kubernetes control plane (marker `k8s`).

`k8s_cluster` builds the toolchain when its cache is cold (progress shown live) and starts one control
plane per session. Without Go the k8s tests are skipped, and the reason is repeated in a banner at the
end of the run so it is never mistaken for a pass; a failed build or start-up is an error, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.k8s.cluster import Cluster
from e2e.k8s.toolchain import (
    Toolchain,
    ToolchainUnavailable,
    ensure_toolchain,
    is_toolchain_cached,
    start_background_build,
)

_skip_reasons: list[str] = []
_background_builds: list[subprocess.Popen[bytes]] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """When k8s tests were collected and the toolchain cache is cold, start building it right away so
    the build overlaps the tests that run before them."""
    if not any(item.get_closest_marker("k8s") for item in session.items) or is_toolchain_cached():
        return
    log_fd, log_name = tempfile.mkstemp(prefix="corral-k8s-build-", suffix=".log")
    os.close(log_fd)
    _background_builds.append(start_background_build(Path(log_name)))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"k8s e2e toolchain cache is cold: building in the background, log {log_name}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    for build in _background_builds:
        if build.poll() is None:
            # A partial build resumes from Go's build cache next time.
            os.killpg(build.pid, signal.SIGTERM)
            build.wait()


@pytest.fixture(scope="session")
def k8s_toolchain(request: pytest.FixtureRequest) -> Toolchain:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # Show build.sh's progress live: a cold build takes many minutes.
    live = capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()
    try:
        with live:
            return ensure_toolchain()
    except ToolchainUnavailable as exc:
        reason = f"Kubernetes e2e toolchain unavailable: {exc}"
        _skip_reasons.append(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def k8s_cluster(k8s_toolchain: Toolchain, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(k8s_toolchain, tmp_path_factory.mktemp("k8s")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def k8s_crds(k8s_cluster: Cluster) -> Cluster:
    """The cluster with Corral's CRDs (and kopf's) installed and established, as the chart leaves
    it: the gateway watches LLMDeployments, and its discovery is not ready until it has listed them."""
    k8s_cluster.apply(Path(__file__).resolve().parents[1] / "crds")
    k8s_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/llmdeployments.corral.dev", "crd/clusterkopfpeerings.kopf.dev", "crd/kopfpeerings.kopf.dev",
    )  # fmt: skip
    return k8s_cluster


@pytest.fixture
def k8s_namespace(k8s_cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    name = f"e2e-{secrets.token_hex(4)}"
    k8s_cluster.kubectl("create", "namespace", name)
    k8s_cluster.wait_until(
        f"default ServiceAccount in {name}",
        lambda: (
            k8s_cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0
        ),
    )
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def operator_kubeconfig(k8s_cluster: Cluster) -> Path:
    """Kubeconfig of the operator's ServiceAccount identity: it can do only what applied RBAC grants."""
    return k8s_cluster.operator_kubeconfig


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for reason in dict.fromkeys(_skip_reasons):
        terminalreporter.section("KUBERNETES E2E TESTS SKIPPED", sep="!", red=True, bold=True)
        terminalreporter.line(reason, red=True, bold=True)
