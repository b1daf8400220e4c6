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


def test_names_the_cluster_would_refuse_are_refused() -> None:
    example = (ROOT / "examples/tiny-llama.yaml").read_text()
    with pytest.raises(SpecError, match="DNS label"):
        local_fleets(example.replace("name: tiny-llama\n", "name: My.Model\n", 1))
    with pytest.raises(SpecError, match="two LLMDeployments named 'tiny-llama'"):
        local_fleets(example + "\n---\n" + example)


def test_not_an_llmdeployment() -> None:
    with pytest.raises(SpecError, match="no LLMDeployment"):
        local_fleets("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")


ALIASED = """
apiVersion: corral.dev/v1alpha1
kind: LLMDeployment
metadata: {name: aliased}
spec:
  model: {name: Qwen/Qwen3-8B, aliases: [qwen], source: {hostPath: {path: /tmp/m}}}
  engine: {image: img:1}
  replicas: 1
"""


def test_aliases_route_locally_as_on_a_cluster(tmp_path: Path) -> None:
    """`corral up -f` hands the gateway the same names Kubernetes discovery would: an alias routes
    to its model (the engine is sent the served name) and /v1/models lists it."""
    import argparse

    from corral_cli import cmd_up
    from corral_gateway.app import create_app
    from corral_gateway.settings import GatewaySettings

    (fleet,) = local_fleets(ALIASED)
    assert (fleet.namespace, fleet.aliases) == ("default", ("qwen",))
    path = tmp_path / "aliased.yaml"
    path.write_text(ALIASED)
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    args = parser.parse_args(["-f", str(path)])
    settings = GatewaySettings(backends={"Qwen/Qwen3-8B": ["http://127.0.0.1:1"]})
    app = create_app(settings)
    cmd_up._route_aliases(app, cmd_up._served_names(args))
    fleet_view = app.api.state.fleet
    route = fleet_view.resolve("qwen")
    assert (route.key, route.upstream) == ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B")
    assert fleet_view.listed_models() == ["Qwen/Qwen3-8B", "qwen"]
    assert fleet_view.resolve("Qwen/Qwen3-8B").key == "Qwen/Qwen3-8B"


def test_the_fp8_example_quantizes_only_the_bf16_checkpoint() -> None:
    fp8_checkpoint, online = local_fleets((ROOT / "examples/llama-fp8.yaml").read_text())
    assert fp8_checkpoint.engine_args.model == "hf://Qwen/Qwen3-8B-FP8@main"
    assert fp8_checkpoint.engine_args.quantization is None  # its config.json says fp8
    assert "--quantization" not in fp8_checkpoint.engine_args.to_cli_args()
    flags = online.engine_args.to_cli_args()
    assert flags[flags.index("--quantization") + 1] == "fp8"
