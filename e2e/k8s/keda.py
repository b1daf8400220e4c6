"""KEDA's real CustomResourceDefinitions for the e2e control plane, from the Go module proxy.

The KEDA module's source holds its generated CRDs (config/crd/bases); `go mod download` fetches the
pinned version into the module cache once. No KEDA controller runs: the tests check that the API
server accepts what the operator renders and that nothing but KEDA would scale.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.16.1"
SCALED_OBJECT_CRD_FILE = "config/crd/bases/keda.sh_scaledobjects.yaml"


class KedaUnavailable(RuntimeError):
    """Go is missing or the module proxy did not serve KEDA."""


def scaled_object_crd() -> Path:
    """Path of KEDA's ScaledObject CRD in the Go module cache (downloaded on first use)."""
    go = shutil.which("go")
    if go is None:
        raise KedaUnavailable("the go command is not installed")
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    result = subprocess.run(
        [go, "mod", "download", "-json", f"{KEDA_MODULE}@{KEDA_VERSION}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
        cwd=Path(__file__).parent,
    )
    if result.returncode != 0:
        raise KedaUnavailable(f"go mod download {KEDA_MODULE}@{KEDA_VERSION}: {result.stdout}{result.stderr}")
    return Path(json.loads(result.stdout)["Dir"]) / SCALED_OBJECT_CRD_FILE
