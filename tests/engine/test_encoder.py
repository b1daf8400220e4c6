"""The BERT-family encoder module: its last hidden states equal transformers' for ragged batches,
each sequence attending to its own tokens only, in float32 and close in bfloat16."""

from __future__ import annotations

import pathlib

import pytest
import torch
from corral_engine.demo_encoder import ENCODER_ARCHITECTURES, write_demo_encoder
from corral_engine.model import encoder as encoder_module
from corral_engine.model.encoder_loader import load_encoder
from transformers import AutoModel, AutoTokenizer

from tests.engine.encoder_checkpoints import edit_tensors, hidden_states, save_hf_encoder

TEXTS = (
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "One",
    "A corral is a pen for keeping animals together, and this project keeps a herd of language models.",
    "What time is it? It is half past nine.",
)


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {arch: write_demo_encoder(root / arch, arch) for arch in ENCODER_ARCHITECTURES}


def _ids(path: pathlib.Path) -> list[torch.Tensor]:
    tok = AutoTokenizer.from_pretrained(path)
    return [torch.tensor(tok(text).input_ids) for text in TEXTS]


def _run(encoder: torch.nn.Module, ids: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return encoder(torch.cat(ids), [len(i) for i in ids])  # [T, H]


@pytest.mark.parametrize("arch", list(ENCODER_ARCHITECTURES))
def test_ragged_batch_matches_transformers_float32(demo_dirs, arch):
    path = demo_dirs[arch]
    ids = _ids(path)
    reference = hidden_states(AutoModel.from_pretrained(path).eval(), ids)  # each sequence alone
    config, encoder = load_encoder(path, torch.float32, "cpu")

    assert config.architecture == ENCODER_ARCHITECTURES[arch]
    batched = _run(encoder, ids)
    assert batched.shape == (sum(len(i) for i in ids), config.hidden_size)
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-5)
    # Each alone gives the rows it had in the batch: no attention leaks between sequences.
    alone = torch.cat([_run(encoder, [i]) for i in ids])
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", list(ENCODER_ARCHITECTURES))
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(demo_dirs, arch):
    path = demo_dirs[arch]
    ids = _ids(path)
    reference = hidden_states(AutoModel.from_pretrained(path).eval(), ids)
    hf_bf16 = hidden_states(AutoModel.from_pretrained(path, dtype=torch.bfloat16).eval(), ids).float()
    _, encoder = load_encoder(path, torch.bfloat16, "cpu")
    assert next(encoder.parameters()).dtype == torch.bfloat16

    ours = _run(encoder, ids)
    assert ours.dtype == torch.bfloat16
    our_error = (ours.float() - reference).abs().max().item()
    hf_error = (hf_bf16 - reference).abs().max().item()
    assert our_error <= 2 * hf_error + 1e-2
    torch.testing.assert_close(ours.float(), hf_bf16, atol=0.1, rtol=0.05)


@pytest.mark.parametrize(
    ("model_class", "overrides"),
    [
        ("BertModel", {"hidden_act": "gelu_new"}),
        ("BertModel", {"hidden_act": "gelu_pytorch_tanh", "type_vocab_size": 1}),
        ("BertForMaskedLM", {}),  # tensors under bert., the MLM head (cls.*) left out
        ("RobertaModel", {"pad_token_id": 1, "max_position_embeddings": 66}),
        ("XLMRobertaModel", {"pad_token_id": 3, "max_position_embeddings": 68, "type_vocab_size": 1}),
    ],
)
def test_variants_match_transformers(tmp_path, model_class, overrides):
    model = save_hf_encoder(tmp_path, model_class, **overrides)
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(5, 300, (n,), generator=generator) for n in (7, 1, 30, 12)]
    config, encoder = load_encoder(tmp_path, torch.float32, "cpu")

    assert config.max_model_len == 64
    torch.testing.assert_close(_run(encoder, ids), hidden_states(model, ids), atol=1e-5, rtol=1e-5)


def test_sharded_checkpoint_and_older_layernorm_names(tmp_path):
    sharded = tmp_path / "sharded"
    model = save_hf_encoder(sharded, "BertModel", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = [torch.tensor([2, 40, 41, 42, 3]), torch.tensor([2, 7, 3])]
    _, encoder = load_encoder(sharded, torch.float32, "cpu")
    torch.testing.assert_close(_run(encoder, ids), hidden_states(model, ids), atol=1e-5, rtol=1e-5)

    old = tmp_path / "old"  # LayerNorm.gamma / .beta, as checkpoints saved by early transformers
    model = save_hf_encoder(old, "BertModel", seed=3)
    edit_tensors(
        old,
        lambda t: {
            k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
            for k, v in t.items()
        },
    )
    _, encoder = load_encoder(old, torch.float32, "cpu")
    torch.testing.assert_close(_run(encoder, ids), hidden_states(model, ids), atol=1e-5, rtol=1e-5)


def test_many_attention_groups_match_one(tmp_path, monkeypatch):
    """A batch split into several padded groups (a small score budget) computes the same rows."""
    save_hf_encoder(tmp_path, "XLMRobertaModel", pad_token_id=1, max_position_embeddings=66)
    _, encoder = load_encoder(tmp_path, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(2)
    lens = [9, 3, 30, 3, 17, 1, 9]
    ids = [torch.randint(5, 300, (n,), generator=generator) for n in lens]
    whole = _run(encoder, ids)
    monkeypatch.setattr(encoder_module, "_MAX_SCORE_ELEMENTS", 4 * 10 * 10 * 2)
    assert len(encoder_module.attention_groups(lens, 4, torch.device("cpu"))) > 3
    torch.testing.assert_close(_run(encoder, ids), whole, atol=1e-5, rtol=1e-5)


def test_positions_per_sequence_with_the_roberta_offset(demo_dirs):
    bert_config, bert = load_encoder(demo_dirs["bert"], torch.float32, "cpu")
    xlmr_config, xlmr = load_encoder(demo_dirs["xlm-roberta"], torch.float32, "cpu")
    cpu = torch.device("cpu")

    assert bert.positions([3, 2], cpu).tolist() == [0, 1, 2, 0, 1]
    assert xlmr.positions([3, 2], cpu).tolist() == [2, 3, 4, 2, 3]  # padding_idx 1, then + 1
    assert (bert_config.max_model_len, xlmr_config.max_model_len) == (512, 512)  # 514 - 1 - 1
    assert xlmr.positions([512], cpu)[-1].item() == 513  # the last row of the table
    with pytest.raises(ValueError, match="513 tokens exceeds max_model_len 512"):
        xlmr(torch.zeros(513, dtype=torch.long), [513])
    with pytest.raises(ValueError, match="seq_lens add up to 4 tokens, input_ids has 5"):
        bert(torch.zeros(5, dtype=torch.long), [2, 2])
