"""A `corral up` subprocess in tests: waiting until its gateway serves."""

from __future__ import annotations

import subprocess

import pytest


def wait_for_banner(up: subprocess.Popen[str]) -> None:
    """Read `up`'s stdout to the banner it prints once the gateway serves (fails if it ends first)."""
    assert up.stdout is not None
    for line in up.stdout:
        if "Corral is up" in line:
            return
    pytest.fail(f"corral up ended before serving: {up.communicate()[1]}")
