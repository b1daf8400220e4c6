"""Turn an LLMDeployment spec into an engine command line: `corral engine` flags or vLLM's.

Pure; shared by the Deployment renderer and by `corral up -f` (local fleets), so one YAML means
the same engine on a laptop and on a cluster.
"""

from __future__ import annotations

import json
import posixpath
import re

from corral_engine.args import EngineArgs

from corral_operator.spec import EngineArgsSpec, LLMDeploymentSpec, SpecError

MODEL_MOUNT_PATH = "/models"
_BYTE_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BYTE_UNITS |= {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_BYTES_RE = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")


def parse_bytes(quantity: str) -> int:
    """'4Gi' -> 4294967296. Only whole-byte quantities (the CRD's pattern) are accepted."""
    match = _BYTES_RE.match(quantity)
    if match is None:
        raise SpecError(f"not a byte quantity: {quantity!r} (expected e.g. 512Mi or 4Gi)")
    return int(match.group(1)) * _BYTE_UNITS[match.group(2) or ""]


def model_path_in_pod(spec: LLMDeploymentSpec) -> str:
    """Where the engine finds the checkpoint inside the container."""
    pvc = spec.model.source.pvc
    if pvc is not None and pvc.path:
        return posixpath.join(MODEL_MOUNT_PATH, pvc.path)
    return MODEL_MOUNT_PATH


def engine_args(spec: LLMDeploymentSpec, model_path: str) -> EngineArgs:
    """The typed engine arguments; raises SpecError when the engine rejects a combination."""
    a: EngineArgsSpec = spec.engine.args
    given: dict[str, object] = {
        "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "block_size": a.block_size,
        "kv_cache_memory_bytes": parse_bytes(a.kv_cache_memory) if a.kv_cache_memory else None,
        "num_kv_blocks": a.num_kv_blocks,
        "max_model_len": a.max_model_len,
        "kv_policy": a.kv_policy,
        "enable_prefix_caching": a.enable_prefix_caching,
        "dtype": a.dtype,
        "max_waiting": a.max_waiting,
    }
    speculative = _speculative_settings(a)
    given["speculative"] = speculative.pop("method", None)  # EngineArgs names the method `speculative`
    given |= speculative
    try:
        return EngineArgs(
            model=model_path,
            served_model_name=spec.model.name,
            **{k: v for k, v in given.items() if v is not None},  # type: ignore[arg-type]
        )
    except ValueError as e:  # corral_engine.args.ArgumentError
        raise SpecError(f"spec.engine.args: {e}") from e


def corral_command(spec: LLMDeploymentSpec, model_path: str, host: str, port: int) -> list[str]:
    """argv for the bundled engine: `corral engine ... --host H --port P` plus extraArgs."""
    args = engine_args(spec, model_path).to_cli_args()
    return ["corral", "engine", *args, "--host", host, "--port", str(port), *spec.engine.extra_args]


def vllm_args(spec: LLMDeploymentSpec, model_path: str, port: int) -> list[str]:
    """Arguments for the vllm/vllm-openai image's entrypoint (its OpenAI API server)."""
    a = spec.engine.args
    out = ["--model", model_path, "--served-model-name", spec.model.name, "--host", "0.0.0.0"]
    out += ["--port", str(port)]
    for flag, value in (
        ("--max-num-seqs", a.max_num_seqs),
        ("--max-num-batched-tokens", a.max_num_batched_tokens),
        ("--block-size", a.block_size),
        ("--max-model-len", a.max_model_len),
        ("--dtype", a.dtype),
        ("--num-gpu-blocks-override", a.num_kv_blocks),
        ("--kv-cache-memory-bytes", parse_bytes(a.kv_cache_memory) if a.kv_cache_memory else None),
    ):
        if value is not None:
            out += [flag, str(value)]
    if a.enable_prefix_caching is not None:
        out.append("--enable-prefix-caching" if a.enable_prefix_caching else "--no-enable-prefix-caching")
    speculative = _speculative_settings(a)
    if speculative:
        out += ["--speculative-config", json.dumps({k: v for k, v in speculative.items() if v is not None})]
    return out + list(spec.engine.extra_args)


def _speculative_settings(a: EngineArgsSpec) -> dict[str, object]:
    """spec.engine.args.speculative under the names both engines use ({} when off)."""
    s = a.speculative
    if s is None:
        return {}
    return {
        "method": s.method,
        "num_speculative_tokens": s.num_speculative_tokens,
        "prompt_lookup_min": s.prompt_lookup_min,
        "prompt_lookup_max": s.prompt_lookup_max,
    }
