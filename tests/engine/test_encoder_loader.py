"""Loading encoder checkpoints: which architectures are encoders, and what is refused, by name."""

from __future__ import annotations

import pytest
import torch
from corral_engine.errors import ModelLoadError
from corral_engine.model.encoder_config import load_encoder_config
from corral_engine.model.encoder_loader import load_encoder
from corral_engine.pooling import is_encoder_architecture

from tests.engine.encoder_checkpoints import edit_config, edit_tensors, save_hf_encoder


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("BertModel", True),
        ("BertForMaskedLM", True),
        ("RobertaModel", True),
        ("XLMRobertaModel", True),
        ("LlamaForCausalLM", False),
        ("BertForSequenceClassification", True),  # a reranker (cross-encoder)
        ("XLMRobertaForSequenceClassification", True),
        ("XLMRobertaForMaskedLM", False),
        ("Qwen2ForSequenceClassification", False),
    ],
)
def test_is_encoder_architecture(arch, expected):
    assert is_encoder_architecture(arch) is expected


def test_pooler_and_position_id_buffers_are_skipped(tmp_path):
    save_hf_encoder(tmp_path, "BertModel")
    edit_tensors(
        tmp_path,
        lambda t: {
            **t,
            "embeddings.position_ids": torch.arange(64)[None],  # saved by transformers before 4.31
            "embeddings.token_type_ids": torch.zeros(1, 64, dtype=torch.long),
        },
    )
    config, encoder = load_encoder(tmp_path, torch.float32, "cpu")
    assert config.architecture == "BertModel"
    assert not any("pooler" in name for name, _ in encoder.named_parameters())


def test_unknown_tensor_is_refused_by_name(tmp_path):
    save_hf_encoder(tmp_path, "BertModel")
    edit_tensors(tmp_path, lambda t: {**t, "encoder.layer.0.attention.self.rotary.weight": torch.zeros(4)})
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor 'encoder\.layer\.0\.attention\.self\.rotary"
    ):
        load_encoder(tmp_path, torch.float32, "cpu")


def test_tensor_of_a_layer_the_config_lacks_is_refused(tmp_path):
    save_hf_encoder(tmp_path, "BertModel")
    edit_config(tmp_path, num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'encoder\.layer\.1\."):
        load_encoder(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize(
    "missing",
    [
        "encoder.layer.1.output.dense.bias",
        "encoder.layer.0.attention.self.key.weight",
        "embeddings.LayerNorm.weight",
    ],
)
def test_missing_tensor_is_refused_by_name(tmp_path, missing):
    save_hf_encoder(tmp_path, "BertModel")
    edit_tensors(tmp_path, lambda t: {k: v for k, v in t.items() if k != missing})
    with pytest.raises(ModelLoadError, match=f"checkpoint is missing tensors: {missing}$"):
        load_encoder(tmp_path, torch.float32, "cpu")


def test_wrong_shape_is_refused(tmp_path):
    save_hf_encoder(tmp_path, "BertModel")
    edit_config(tmp_path, intermediate_size=96)
    with pytest.raises(
        ModelLoadError, match=r"'encoder\.layer\.0\.intermediate\.dense\.(weight|bias)' has shape \(128"
    ):
        load_encoder(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_relative_position_embeddings_are_refused(tmp_path, kind):
    save_hf_encoder(tmp_path, "BertModel")
    edit_config(tmp_path, position_embedding_type=kind)
    with pytest.raises(ModelLoadError, match=f"position_embedding_type '{kind}' is not supported"):
        load_encoder(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, r"architecture \['LlamaForCausalLM'\] is not an encoder"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"is_decoder": True}, "configured as a decoder"),
        (
            {"max_position_embeddings": 2, "pad_token_id": 1, "architectures": ["RobertaModel"]},
            "no positions",
        ),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, fields, message):
    save_hf_encoder(tmp_path, "BertModel")
    edit_config(tmp_path, **fields)
    with pytest.raises(ModelLoadError, match=message):
        load_encoder_config(tmp_path)


def test_no_config_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_encoder(tmp_path, torch.float32, "cpu")


def test_an_encoder_start_up_reads_and_parses_config_json_once(tmp_path, monkeypatch):
    """load_model_config's EncoderConfig is the one the runner loads with: config.json is read
    once and parsed by transformers once (was: three reads, two AutoConfig parses)."""
    import pathlib

    import transformers
    from corral_engine.args import EngineArgs
    from corral_engine.model.config import load_model_config
    from corral_engine.model.encoder_runner import EncoderRunner

    save_hf_encoder(tmp_path, "BertModel")
    reads: list[str] = []
    parses: list[str] = []
    read_text, from_pretrained = pathlib.Path.read_text, transformers.AutoConfig.from_pretrained

    def counting_read(self: pathlib.Path, *args: object, **kwargs: object) -> str:
        if self.name == "config.json" and self.parent == tmp_path:
            reads.append(str(self))
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    def counting_parse(*args: object, **kwargs: object) -> object:
        parses.append(str(args[0]))
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counting_read)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counting_parse)
    config = load_model_config(tmp_path)
    runner = EncoderRunner(config, EngineArgs(model=str(tmp_path), dtype="float32"), 64)
    assert (len(reads), len(parses)) == (1, 1)
    assert runner.model.config is config.encoder
