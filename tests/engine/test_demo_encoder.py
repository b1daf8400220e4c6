"""`corral demo-model --arch bert|xlm-roberta [--reranker]`: tiny encoder checkpoints transformers
loads, with a local tokenizer adding the model's special tokens, in the sentence-transformers layout
(a reranker: one-label *ForSequenceClassification)."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
from corral_cli.main import main as corral_main
from corral_engine.demo_encoder import ENCODER_ARCHITECTURES, RERANKER_ARCHITECTURES
from corral_engine.demo_encoder_tokenizer import train_encoder_tokenizer
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

# (cls, sep, pad, unk, mask) ids: BERT's WordPiece specials first; XLM-RoBERTa's <s> <pad> </s>
# <unk> first and <mask> last, as the real vocabularies have them.
SPECIAL_IDS = {"bert": (2, 3, 0, 1, 4), "xlm-roberta": (0, 2, 1, 3, 1023)}
POOLING = {"bert": "pooling_mode_mean_tokens", "xlm-roberta": "pooling_mode_cls_token"}


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("cli-encoders")
    for arch in ENCODER_ARCHITECTURES:
        assert corral_main(["demo-model", str(root / arch), "--arch", arch, "--quiet"]) == 0
    return {arch: root / arch for arch in ENCODER_ARCHITECTURES}


@pytest.mark.parametrize("arch", list(ENCODER_ARCHITECTURES))
def test_cli_writes_a_checkpoint_transformers_loads(cli_dirs, arch):
    path = cli_dirs[arch]
    model = AutoModel.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)

    assert type(model).__name__ == ENCODER_ARCHITECTURES[arch] == config.architectures[0]
    assert len(tok) == config.vocab_size == model.get_input_embeddings().weight.shape[0]
    cls, sep, pad, unk, mask = SPECIAL_IDS[arch]
    assert (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id) == (cls, sep, pad)
    assert (tok.unk_token_id, tok.mask_token_id) == (unk, mask)
    assert tok.pad_token_id == config.pad_token_id
    ids = tok("the quick brown fox").input_ids
    assert ids[0] == cls and ids[-1] == sep and len(ids) > 3
    assert tok.decode(ids, skip_special_tokens=True) == "the quick brown fox"


@pytest.mark.parametrize("arch", list(ENCODER_ARCHITECTURES))
def test_sentence_transformers_layout(cli_dirs, arch):
    path = cli_dirs[arch]
    modules = json.loads((path / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Normalize"]
    assert modules[1]["type"] == "sentence_transformers.models.Pooling"
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert [mode for mode, on in pooling.items() if mode.startswith("pooling_mode") and on] == [POOLING[arch]]
    assert pooling["word_embedding_dimension"] == AutoConfig.from_pretrained(path).hidden_size
    assert (path / "2_Normalize").is_dir()
    assert json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"] <= 512


@pytest.mark.parametrize(
    ("arch", "text", "decoded"),
    [
        ("bert", "Hello, World! How are you today?", "hello, world! how are you today?"),
        ("bert", "Café naïve", "cafe naive"),  # lower-cased, accents stripped, as uncased BERT
        ("xlm-roberta", "Hello, world! How are you today?", "Hello, world! How are you today?"),
        ("xlm-roberta", "Café naïve 你好", "Café naïve 你好"),
    ],
)
def test_tokenizer_round_trips_and_adds_special_tokens(arch, text, decoded):
    tok = train_encoder_tokenizer(arch, seed=0, vocab_size=1024)
    cls, sep, *_ = SPECIAL_IDS[arch]
    encoding = tok.encode(text)
    assert encoding.ids[0] == cls and encoding.ids[-1] == sep
    assert SPECIAL_IDS[arch][3] not in encoding.ids  # no <unk>: every piece is in the vocabulary
    assert tok.decode(encoding.ids) == decoded
    assert tok.encode(text, add_special_tokens=False).ids == encoding.ids[1:-1]


def test_same_seed_writes_the_same_files(cli_dirs, tmp_path):
    assert corral_main(["demo-model", str(tmp_path), "--arch", "xlm-roberta", "--quiet"]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json", "1_Pooling/config.json"):
        digests = {
            hashlib.sha256((p / name).read_bytes()).hexdigest() for p in (tmp_path, cli_dirs["xlm-roberta"])
        }
        assert len(digests) == 1, name
    # Unigram training's float sums and tie order vary run to run; the saved tokenizer does not.
    assert (
        len({train_encoder_tokenizer("xlm-roberta", seed=0, vocab_size=1024).to_str() for _ in range(3)}) == 1
    )
    assert len({train_encoder_tokenizer("bert", seed=0, vocab_size=1024).to_str() for _ in range(3)}) == 1


@pytest.mark.parametrize("flags", [["--preset", "small"], ["--no-weights"], ["--quantization", "fp8"]])
def test_cli_refuses_decoder_only_options(tmp_path, caplog, flags):
    assert corral_main(["demo-model", str(tmp_path / "x"), "--arch", "bert", "--quiet", *flags]) == 2
    assert "not supported" in caplog.text
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch", list(RERANKER_ARCHITECTURES))
def test_cli_writes_a_one_label_reranker_transformers_loads(tmp_path, arch):
    assert corral_main(["demo-model", str(tmp_path), "--arch", arch, "--reranker", "--quiet"]) == 0
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert type(model).__name__ == RERANKER_ARCHITECTURES[arch] and model.config.num_labels == 1
    assert not (tmp_path / "modules.json").exists()  # no pooling modules: the head reads the first token
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert model(**tok("a query", "a document", return_tensors="pt")).logits.shape == (1, 1)


def test_cli_refuses_a_decoder_reranker(tmp_path, caplog):
    assert corral_main(["demo-model", str(tmp_path / "x"), "--arch", "llama", "--reranker", "--quiet"]) == 2
    assert "a classifier is an encoder" in caplog.text
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch", list(RERANKER_ARCHITECTURES))
def test_cli_writes_a_classifier_of_n_labels_transformers_loads(tmp_path, arch):
    assert corral_main(["demo-model", str(tmp_path), "--arch", arch, "--classifier", "3", "--quiet"]) == 0
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert type(model).__name__ == RERANKER_ARCHITECTURES[arch] and model.config.num_labels == 3
    assert model.config.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    assert not (tmp_path / "modules.json").exists()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert model(**tok("a sentence", return_tensors="pt")).logits.shape == (1, 3)


@pytest.mark.parametrize("arch", list(RERANKER_ARCHITECTURES))
def test_cli_writes_a_token_classifier_transformers_loads(tmp_path, arch):
    from transformers import AutoModelForTokenClassification

    flags = ["--arch", arch, "--classifier", "4", "--token-classifier", "--quiet"]
    assert corral_main(["demo-model", str(tmp_path), *flags]) == 0
    model = AutoModelForTokenClassification.from_pretrained(tmp_path)
    assert type(model).__name__.endswith("ForTokenClassification") and model.config.num_labels == 4
    tok = AutoTokenizer.from_pretrained(tmp_path)
    encoded = tok("a sentence", return_tensors="pt")
    assert model(**encoded).logits.shape == (1, encoded.input_ids.shape[1], 4)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--arch", "bert", "--token-classifier"], "needs --classifier N"),
        (["--arch", "bert", "--classifier", "0"], "at least 1"),
        (["--arch", "bert", "--classifier", "2", "--reranker"], "not both"),
        (["--arch", "llama", "--classifier", "2"], "a classifier is an encoder"),
    ],
)
def test_cli_refuses_a_bad_classifier(tmp_path, caplog, flags, said):
    assert corral_main(["demo-model", str(tmp_path / "x"), *flags, "--quiet"]) == 2
    assert said in caplog.text
    assert not (tmp_path / "x").exists()
