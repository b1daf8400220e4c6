"""Turn an LLMDeployment spec into an engine command line: `corral engine` flags or vLLM's.

Pure; shared by the Deployment renderer and by `corral up -f` (local fleets), so one YAML means
the same engine on a laptop and on a cluster.
"""

from __future__ import annotations

import json
import posixpath

from corral_engine.args import OPTIONS, ArgumentError, EngineArgs

from corral_operator.engine_args_spec import given_options
from corral_operator.spec import LLMDeploymentSpec, SpecError

MODEL_MOUNT_PATH = "/models"


def model_path_in_pod(spec: LLMDeploymentSpec) -> str:
    """Where the engine finds the checkpoint inside the container."""
    pvc = spec.model.source.pvc
    if pvc is not None and pvc.path:
        return posixpath.join(MODEL_MOUNT_PATH, pvc.path)
    return MODEL_MOUNT_PATH


def engine_args(spec: LLMDeploymentSpec, model_path: str) -> EngineArgs:
    """The typed engine arguments; raises SpecError when the engine rejects a combination."""
    try:
        return EngineArgs(**_given(spec, model_path))  # type: ignore[arg-type]
    except ArgumentError as e:
        raise SpecError(f"spec.engine.args: {e}") from e


def corral_command(spec: LLMDeploymentSpec, model_path: str, host: str, port: int) -> list[str]:
    """argv for the bundled engine: `corral engine ... --host H --port P` plus extraArgs."""
    args = engine_args(spec, model_path).to_cli_args()
    return ["corral", "engine", *args, "--host", host, "--port", str(port), *spec.engine.extra_args]


def vllm_args(spec: LLMDeploymentSpec, model_path: str, port: int) -> list[str]:
    """Arguments for the vllm/vllm-openai image's entrypoint (its OpenAI API server): only the
    options the spec sets, so vLLM's own defaults hold for the rest."""
    engine_args(spec, model_path)  # the engine's own checks hold for either engine kind
    flags = vllm_flags(_given(spec, model_path))
    gpus = spec.resources.gpu
    if gpus > 1 and not any(a.startswith("--tensor-parallel-size") for a in spec.engine.extra_args):
        flags += ["--tensor-parallel-size", str(gpus)]  # one replica spans its GPUs
    return [*flags, "--host", "0.0.0.0", "--port", str(port), *spec.engine.extra_args]


def vllm_flags(given: dict[str, object]) -> list[str]:
    """vLLM's flags for engine options (name -> value), from each option's declared equivalent."""
    out: list[str] = []
    json_flags: dict[str, dict[str, object]] = {}
    for name, value in given.items():
        vllm = OPTIONS[name].vllm
        if vllm is None:
            raise SpecError(f"spec.engine.args: {name} has no vLLM equivalent")
        if vllm.json_key is not None:
            json_flags.setdefault(vllm.flag, {})[vllm.json_key] = value
        elif isinstance(value, bool):  # vLLM's boolean flags take a --no- form
            out.append(vllm.flag if value else "--no-" + vllm.flag.removeprefix("--"))
        else:
            out += [vllm.flag, str(value)]
    for flag, obj in json_flags.items():
        out += [flag, json.dumps(obj)]
    return out


def _given(spec: LLMDeploymentSpec, model_path: str) -> dict[str, object]:
    return {"model": model_path, "served_model_name": spec.model.name, **given_options(spec.engine.args)}
