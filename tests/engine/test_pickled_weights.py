"""Checkpoints whose weights are PyTorch pickles (`pytorch_model.bin`, sharded with an index), as
older hub repositories ship them: they load (weights_only) and generate what transformers does;
safetensors win where a checkpoint has both; a pickle holding code is refused."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Mapping

import pytest
import torch
from corral_engine.errors import ModelLoadError
from corral_engine.model.loader import checkpoint_files, iter_tensors
from corral_engine.sampling_params import SamplingParams
from safetensors.torch import load_file

from tests.engine.helpers import make_engine, random_prompts, run_checked, transformers_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def pickled_copy(src: pathlib.Path, out: pathlib.Path, shards: int = 1, legacy: bool = False) -> pathlib.Path:
    """`src` with its safetensors weights rewritten as pytorch_model*.bin (and an index when
    sharded): what `save_pretrained(safe_serialization=False)` writes."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    names = sorted(tensors)
    if shards == 1:
        torch.save(tensors, out / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
        return out
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {name: tensors[name] for name in names[i::shards]}
        torch.save(part, out / file)
        weight_map.update(dict.fromkeys(part, file))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _greedy(model_dir: pathlib.Path, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    engine = make_engine(model_dir, **kwargs)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    final = run_checked(engine)
    engine.runner.close()
    return [final[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize(("shards", "legacy"), [(1, False), (3, False), (1, True)])
def test_pickled_weights_generate_as_transformers(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, shards: int, legacy: bool
) -> None:
    """One file, three shards with an index, and the pre-1.6 (not memory-mappable) format."""
    model_dir = pickled_copy(tiny_model_dir, tmp_path / "bin", shards, legacy)
    assert not list(model_dir.glob("*.safetensors"))
    prompts = random_prompts(3, 200, seed=7)
    assert _greedy(model_dir, prompts) == transformers_greedy(tiny_model_dir, prompts, 8)


def test_pickled_weights_on_two_ranks(
    tiny_model_dirs: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """Each rank cuts its slices out of the unpickled tensors (a fused qkv/gate_up with a
    vocabulary-parallel embedding): the same tokens as the safetensors checkpoint on one rank."""
    src = tiny_model_dirs["qwen2"]
    prompts = random_prompts(3, 200, seed=8)
    assert _greedy(pickled_copy(src, tmp_path / "bin", 2), prompts, tensor_parallel_size=2) == _greedy(
        src, prompts
    )


def test_slices_equal_the_safetensors_slices(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model_dir = pickled_copy(tiny_model_dir, tmp_path / "bin", 2)
    cuts = {
        "model.embed_tokens.weight": (0, 3, 5),
        "model.layers.0.mlp.down_proj.weight": [(1, 0, 4), (1, 8, 4)],
    }

    def slicer(name: str):  # type: ignore[no-untyped-def]
        return cuts.get(name, False)

    pickled = dict(iter_tensors(checkpoint_files(model_dir), slicer))
    safe = dict(iter_tensors(checkpoint_files(tiny_model_dir), slicer))
    assert pickled.keys() == safe.keys() == cuts.keys()
    for name, tensor in safe.items():
        assert torch.equal(pickled[name], tensor)


def test_safetensors_win_over_pickles(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model_dir = pickled_copy(tiny_model_dir, tmp_path / "both")
    for file in tiny_model_dir.glob("*.safetensors"):
        shutil.copy(file, model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"not read")
    assert [f.suffix for f in checkpoint_files(model_dir)] == [".safetensors"]


class _Payload:
    """An object whose unpickling would run code: weights_only refuses it."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("pwned",))


def test_a_pickle_with_code_or_no_tensors_is_refused(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model_dir = pickled_copy(tiny_model_dir, tmp_path / "bad")
    torch.save({"model.embed_tokens.weight": _Payload()}, model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin: cannot read PyTorch weights"):
        list(iter_tensors(checkpoint_files(model_dir)))
    torch.save([torch.zeros(2)], model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="holds a list, not a state dict"):
        list(iter_tensors(checkpoint_files(model_dir)))


def test_no_weights_at_all_names_both_formats(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model_dir = pickled_copy(tiny_model_dir, tmp_path / "none")
    (model_dir / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors and no pytorch_model\*\.bin"):
        checkpoint_files(model_dir)


def test_a_pickled_encoder_loads_the_same_weights(tmp_path: pathlib.Path) -> None:
    from corral_engine.model.encoder_loader import load_encoder

    from tests.engine.encoder_checkpoints import save_hf_encoder

    save_hf_encoder(tmp_path / "safe", "BertModel")
    _, expected = load_encoder(tmp_path / "safe", torch.float32, "cpu")
    _, got = load_encoder(pickled_copy(tmp_path / "safe", tmp_path / "bin"), torch.float32, "cpu")
    want = dict(expected.named_parameters())
    for name, param in got.named_parameters():
        assert torch.equal(param, want[name]), name
