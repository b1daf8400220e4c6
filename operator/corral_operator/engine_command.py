"""Turn an LLMDeployment spec into an engine command line: `corral engine` flags or vLLM's.

Pure; shared by the Deployment renderer and by `corral up -f` (local fleets), so one YAML means
the same engine on a laptop and on a cluster.
"""

from __future__ import annotations

import json
import posixpath

from corral_engine.args import OPTIONS, ArgumentError, EngineArgs
from corral_engine.sources.uri import cache_subdir, parse_model_uri

from corral_operator.engine_args_spec import given_options
from corral_operator.spec import LLMDeploymentSpec, SpecError

MODEL_MOUNT_PATH = "/models"


MODEL_CACHE_PATH = "/models-cache"  # the download cache volume, in the init container and the engine
PVC_ROOT = "/mnt/pvc"  # pvc://CLAIM/PATH is read at PVC_ROOT/CLAIM/PATH (CORRAL_PVC_ROOT's default)


def model_path_in_pod(spec: LLMDeploymentSpec) -> str:
    """What the engine's --model says inside the container: the bundled engine takes a model URI
    (found complete in the cache the init container filled, or under PVC_ROOT); vLLM a directory."""
    model = spec.model
    if model.uri is not None:
        uri = parse_model_uri(model.uri)
        if spec.engine.kind == "corral":
            return model.uri
        if uri.scheme == "pvc":
            return posixpath.join(PVC_ROOT, uri.location, uri.path)
        return posixpath.join(MODEL_CACHE_PATH, str(cache_subdir(uri, model.s3_endpoint)))
    pvc = model.source.pvc if model.source is not None else None
    if pvc is not None and pvc.path:
        return posixpath.join(MODEL_MOUNT_PATH, pvc.path)
    return MODEL_MOUNT_PATH


def adapter_paths_in_pod(spec: LLMDeploymentSpec) -> list[tuple[str, str]]:
    """(served name, directory) of each LoRA adapter inside the container, for either engine kind:
    its cache entry (hf://, s3://, filled by its init container) or its place on its claim (pvc://)."""
    out = []
    for adapter in spec.adapters:
        uri = parse_model_uri(adapter.uri)
        if uri.scheme == "pvc":
            path = posixpath.join(PVC_ROOT, uri.location, uri.path)
        else:
            path = posixpath.join(MODEL_CACHE_PATH, str(cache_subdir(uri, spec.model.s3_endpoint)))
        out.append((adapter.name, path))
    return out


def lora_flags(spec: LLMDeploymentSpec) -> list[str]:
    """The engine's LoRA flags for the adapters' directories inside the container."""
    return lora_module_flags(adapter_paths_in_pod(spec))


def lora_module_flags(adapters: list[tuple[str, str]]) -> list[str]:
    """`--enable-lora --lora-modules NAME=PATH ...` for (served name, directory) pairs (vLLM's flags,
    which the bundled engine shares), or nothing without adapters. vLLM reads an item with a `,` or a
    second `=` (an S3 key such as dt=2024) as JSON, so such a path goes in its JSON form."""
    modules = [
        json.dumps({"name": name, "path": path}) if "=" in path or "," in path else f"{name}={path}"
        for name, path in adapters
    ]
    return ["--enable-lora", "--lora-modules", *modules] if modules else []


def fetch_command(spec: LLMDeploymentSpec, uri: str | None = None) -> list[str]:
    """An init container's argv: download the model (or the adapter at `uri`) into the cache volume
    (docs/models.md)."""
    return ["corral", "fetch-model", uri or str(spec.model.uri), "--cache-dir", MODEL_CACHE_PATH]


def engine_args(spec: LLMDeploymentSpec, model_path: str) -> EngineArgs:
    """The typed engine arguments; raises SpecError when the engine rejects a combination."""
    try:
        return EngineArgs(**_given(spec, model_path))  # type: ignore[arg-type]
    except ArgumentError as e:
        raise SpecError(f"spec.engine.args: {e}") from e


def corral_command(spec: LLMDeploymentSpec, model_path: str, host: str, port: int) -> list[str]:
    """argv for the bundled engine: `corral engine ... --host H --port P` plus extraArgs."""
    args = engine_args(spec, model_path).to_cli_args()
    if spec.model.is_downloaded:
        args += ["--model-cache-dir", MODEL_CACHE_PATH]
    args += lora_flags(spec)
    return ["corral", "engine", *args, "--host", host, "--port", str(port), *spec.engine.extra_args]


def vllm_args(spec: LLMDeploymentSpec, model_path: str, port: int) -> list[str]:
    """Arguments for the vllm/vllm-openai image's entrypoint (its OpenAI API server): only the
    options the spec sets, so vLLM's own defaults hold for the rest."""
    engine_args(spec, model_path)  # the engine's own checks hold for either engine kind
    flags = vllm_flags(_given(spec, model_path)) + lora_flags(spec)
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
        elif isinstance(value, list | tuple):  # a list option: its items after the one flag
            out += [*vllm.also, vllm.flag, *map(str, value)]
        else:
            out += [*vllm.also, vllm.flag, str(value)]
    for flag, obj in json_flags.items():
        out += [flag, json.dumps(obj)]
    return out


def _given(spec: LLMDeploymentSpec, model_path: str) -> dict[str, object]:
    given = {"model": model_path, "served_model_name": spec.model.name, **given_options(spec.engine.args)}
    gpus = spec.resources.gpu
    if gpus > 1 and _extra_tensor_parallel_size(spec) is None:
        given["tensor_parallel_size"] = gpus  # one replica spans its GPUs, with either engine kind
    return given


def tensor_parallel_size(spec: LLMDeploymentSpec) -> int:
    """The ranks one replica runs: an extraArgs split wins, else its GPUs, else 1 (for status)."""
    explicit = _extra_tensor_parallel_size(spec)
    if explicit is not None:
        return explicit
    return max(1, spec.resources.gpu)


def _extra_tensor_parallel_size(spec: LLMDeploymentSpec) -> int | None:
    """`--tensor-parallel-size N`, `--tensor-parallel-size=N` or `-tp N` in extraArgs, if any."""
    args = spec.engine.extra_args
    for i, arg in enumerate(args):
        flag, has_value, value = arg.partition("=")
        if flag in ("--tensor-parallel-size", "-tp"):
            text = value if has_value else (args[i + 1] if i + 1 < len(args) else "")
            return int(text) if text.isdigit() else 1
    return None
