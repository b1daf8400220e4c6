"""`corral up -f`: an LLMDeployment mapped to local fleet parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
from corral_operator.local import local_fleets
from corral_operator.spec import SpecError

ROOT = Path(__file__).resolve().parents[2]


def test_example_maps_to_local_engines() -> None:
    (fleet,) = local_fleets((ROOT / "examples/tiny-llama.yaml").read_text())
    assert fleet.name == "tiny-llama" and fleet.served_model_name == "tiny-llama"
    assert fleet.replicas == 2 and fleet.engine_kind == "corral"
    assert fleet.engine_args.model == "/var/lib/corral/models/tiny-llama"
    assert fleet.engine_args.max_num_seqs == 32 and fleet.engine_args.kv_cache_memory_bytes == 256 << 20


def test_model_path_override_and_pvc_sources() -> None:
    text = (ROOT / "examples/scale-to-zero.yaml").read_text()
    with pytest.raises(SpecError, match="PVC"):
        local_fleets(text)
    (fleet,) = local_fleets(text, model_path="/tmp/ckpt")
    assert fleet.engine_args.model == "/tmp/ckpt"
    assert fleet.replicas == 1  # minReplicas 0 still runs one engine locally


def test_not_an_llmdeployment() -> None:
    with pytest.raises(SpecError, match="no LLMDeployment"):
        local_fleets("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
