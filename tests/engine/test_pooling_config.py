"""The pure part of embedding models (corral_engine.pooling): --runner auto, --pooler-config, the
checkpoint's sentence-transformers files, the order they apply in, and the request checks."""

from __future__ import annotations

import json
import pathlib

import pytest
from corral_engine import EngineArgs, PoolingParams, SamplingParams
from corral_engine.args import ArgumentError
from corral_engine.demo_embedding import write_sentence_transformers_files
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.pooling import (
    EmbedSpec,
    PoolerConfig,
    causal_implementation,
    choose_runner,
    classify_activation,
    matryoshka_of,
    parse_pooler_config,
    resolve_pooler,
    sentence_transformers_pooling,
)


@pytest.mark.parametrize(
    ("architectures", "runner"),
    [
        (["Qwen2Model"], "pooling"),
        (["MistralModel"], "pooling"),
        (["LlamaModel"], "pooling"),
        (["Qwen3EmbeddingModel"], "pooling"),
        (["XForTextEncoding"], "pooling"),
        (["BertForMaskedLM"], "pooling"),  # an encoder: pooled whatever its head
        (["XLMRobertaForSequenceClassification"], "pooling"),
        (["Qwen3ForCausalLM"], "generate"),  # Qwen3-Embedding's: it needs --runner pooling
        (["Gemma3ForConditionalGeneration"], "generate"),
        ([], "generate"),
    ],
)
def test_runner_auto_follows_the_architecture(architectures: list[str], runner: str) -> None:
    assert choose_runner("auto", architectures) == runner
    assert choose_runner("pooling", ["LlamaForCausalLM"]) == "pooling"
    assert choose_runner("generate", ["Qwen2Model"]) == "generate"


def test_a_base_model_class_runs_on_its_causal_implementation() -> None:
    assert causal_implementation("Qwen2Model") == "Qwen2ForCausalLM"
    assert causal_implementation("MistralModel") == "MistralForCausalLM"
    assert causal_implementation("Gemma3TextModel") == "Gemma3ForCausalLM"
    assert causal_implementation("LlamaForCausalLM") == "LlamaForCausalLM"


def test_pooler_config_takes_vllms_keys_and_refuses_others() -> None:
    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == {
        "pooling_type": "MEAN",
        "normalize": False,
    }
    assert parse_pooler_config("{}") == {}
    for bad, said in [
        ('{"pooling_type": "MAX"}', "pooling_type must be one of LAST, MEAN, CLS"),
        ('{"normalize": "yes"}', "normalize must be true or false"),
        ('{"softmax": true, "dimensions": 8}', "unknown or unsupported key(s) dimensions, softmax"),
        ("[1]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ]:
        with pytest.raises(ArgumentError, match=said.replace("(", r"\(").replace(")", r"\)")):
            parse_pooler_config(bad)
    with pytest.raises(ArgumentError, match="unknown or unsupported"):
        EngineArgs(model="m", pooler_config='{"pooling": "MEAN"}')  # checked with the other arguments


@pytest.mark.parametrize(
    ("pooling", "normalize", "expected"),
    [("lasttoken", True, "LAST"), ("mean", False, "MEAN"), ("cls", True, "CLS")],
)
def test_sentence_transformers_files_set_the_pooling(
    tmp_path: pathlib.Path, pooling: str, normalize: bool, expected: str
) -> None:
    write_sentence_transformers_files(tmp_path, 64, pooling, normalize)
    assert sentence_transformers_pooling(tmp_path) == {"pooling_type": expected, "normalize": normalize}


def test_an_unsupported_sentence_transformers_pooling_is_refused(tmp_path: pathlib.Path) -> None:
    write_sentence_transformers_files(tmp_path, 64, "mean", True)
    config = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    config |= {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens is not supported"):
        sentence_transformers_pooling(tmp_path)
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        resolve_pooler(tmp_path, None)
    # --pooler-config chooses one instead: the Normalize module still counts.
    assert resolve_pooler(tmp_path, '{"pooling_type": "LAST"}') == PoolerConfig("LAST", True)


def test_defaults_apply_in_order_flag_then_checkpoint_then_vllms(tmp_path: pathlib.Path) -> None:
    assert resolve_pooler(tmp_path, None) == PoolerConfig("LAST", True)  # vLLM's embed default
    write_sentence_transformers_files(tmp_path, 64, "mean", False)
    assert resolve_pooler(tmp_path, None) == PoolerConfig("MEAN", False)
    assert resolve_pooler(tmp_path, '{"normalize": true}') == PoolerConfig("MEAN", True)  # per key
    assert resolve_pooler(tmp_path, '{"pooling_type": "CLS"}') == PoolerConfig("CLS", False)


def test_matryoshka_as_config_json_says() -> None:
    assert matryoshka_of({}) == (False, None)
    assert matryoshka_of({"is_matryoshka": True}) == (True, None)
    assert matryoshka_of({"matryoshka_dimensions": [32, 64]}) == (True, (32, 64))
    with pytest.raises(ModelLoadError):
        matryoshka_of({"matryoshka_dimensions": "64"})


def test_request_checks_name_the_runner_and_the_dimensions() -> None:
    generate = EmbedSpec("m")
    pooling = EmbedSpec("m", "pooling", 64, True, (16, 64))
    generate.check(SamplingParams())
    pooling.check(PoolingParams(dimensions=16))
    with pytest.raises(InvalidRequestError, match="--runner generate"):
        generate.check(PoolingParams())
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        pooling.check(SamplingParams())
    for dimensions, said in [(0, "greater than 0"), (32, r"\[16, 64\]")]:
        with pytest.raises(InvalidRequestError, match=said) as refused:
            pooling.check(PoolingParams(dimensions=dimensions))
        assert refused.value.param == "dimensions"
    with pytest.raises(InvalidRequestError, match="more than the model's 64"):
        EmbedSpec("m", "pooling", 64, True).check(PoolingParams(dimensions=65))
    with pytest.raises(InvalidRequestError, match="does not support matryoshka"):
        EmbedSpec("m", "pooling", 64).check(PoolingParams(dimensions=16))


@pytest.mark.parametrize(
    ("problem_type", "use_activation", "activation"),
    [
        (None, True, "auto"),  # softmax over labels; one label's sigmoid
        ("single_label_classification", True, "auto"),
        ("multi_label_classification", True, "sigmoid"),
        ("regression", True, "none"),
        ("multi_label_classification", False, "none"),  # use_activation: false, the logits
    ],
)
def test_classify_activation_follows_vllms_rule(
    problem_type: str | None, use_activation: bool, activation: str
) -> None:
    assert classify_activation(problem_type, use_activation) == activation


def test_classifier_scores_activate_as_asked() -> None:
    import torch
    from corral_engine.model.pooler import classifier_scores

    logits = torch.tensor([1.0, -2.0, 0.5])
    assert classifier_scores(logits) == pytest.approx(torch.softmax(logits, -1).tolist())
    assert classifier_scores(logits, "sigmoid") == pytest.approx(torch.sigmoid(logits).tolist())
    assert classifier_scores(logits, "none") == pytest.approx(logits.tolist())
    assert classifier_scores(logits[:1]) == pytest.approx(torch.sigmoid(logits[:1]).tolist())


def test_per_token_outputs_are_finished_row_by_row_and_flattened() -> None:
    """token_classify: each token's own softmax; token_embed: each row scaled to unit length."""
    import torch
    from corral_engine.model.pooler import finish_output

    logits = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])  # [tokens, labels]
    probs = finish_output(logits, PoolingParams(task="token_classify"), True)
    assert probs == pytest.approx(torch.softmax(logits, -1).flatten().tolist())
    rows = torch.tensor([[3.0, 4.0], [0.0, -2.0]])  # [tokens, hidden]
    assert finish_output(rows, PoolingParams(task="token_embed"), True) == pytest.approx(
        [0.6, 0.8, 0.0, -1.0]
    )
    unit = finish_output(rows, PoolingParams(task="token_embed", normalize=False), True)
    assert unit == pytest.approx(rows.flatten().tolist())


def test_each_kind_of_model_serves_vllms_tasks_its_own_first() -> None:
    """The tasks /pooling may name, the default (no task) first; the others refused, saying why."""
    assert EmbedSpec("m").tasks == () and EmbedSpec("m").task is None
    decoder = EmbedSpec("m", "pooling", 64)
    encoder = EmbedSpec("m", "pooling", 64, is_encoder=True)
    reranker = EmbedSpec("m", "pooling", 64, num_labels=1, is_encoder=True)
    tagger = EmbedSpec("m", "pooling", 64, num_labels=5, is_token_classifier=True, is_encoder=True)
    assert decoder.tasks == ("embed",) and encoder.tasks == ("embed", "token_embed")
    assert reranker.tasks == ("classify",) and tagger.tasks == ("token_classify",)
    encoder.check(PoolingParams(task="token_embed"))
    tagger.check(PoolingParams(task="token_classify"))
    with pytest.raises(InvalidRequestError, match=r"not an encoder: token_embed .* encoder models"):
        decoder.check(PoolingParams(task="token_embed"))
    with pytest.raises(InvalidRequestError, match=r"token_classify needs .*\*ForTokenClassification"):
        reranker.check(PoolingParams(task="token_classify"))
    with pytest.raises(
        InvalidRequestError, match=r"does not serve classify requests .*/pooling \(task token_classify\)"
    ):
        tagger.check(PoolingParams(task="classify"))
