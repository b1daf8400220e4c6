"""Every request field OpenAI or vLLM defines is implemented or refused with a 400 naming it; the
implemented ones change what they should (on the tiny random-weight model, through the openai
client); unknown fields are ignored with a warning."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from corral_engine.server.api_chat import ChatCompletionRequest
from corral_engine.server.api_models import CompletionRequest
from corral_engine.server.request_fields import REFUSED_CHAT, REFUSED_COMPLETION
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from tests.server.real_engine import openai_client

MODEL = "tiny-llama"
ASK: Any = [{"role": "user", "content": "Hello there"}]

# vLLM's extra request fields (vllm/entrypoints/openai/protocol.py), both endpoints unless marked.
VLLM_COMMON = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "response_format", "structured_outputs", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "add_special_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
}  # fmt: skip
VLLM_CHAT = {
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning", "reasoning_effort",
}  # fmt: skip
VLLM_COMPLETION = {"prompt_embeds", "best_of", "echo", "suffix"}

# Each implemented field and where its behaviour is tested.
IMPLEMENTED_COMMON = {
    "model": "test_server_api", "temperature": "test_server_api", "top_p": "test_sampler",
    "top_k": "test_sampler", "min_p": "test_sampler", "presence_penalty": "test_sampler",
    "frequency_penalty": "test_sampler", "repetition_penalty": "test_sampler", "seed": "test_server_api",
    "stop": "test_server_api", "stop_token_ids": "test_engine_api", "ignore_eos": "test_engine_api",
    "include_stop_str_in_output": "test_server_api", "n": "test_server_api", "stream": "test_server_api",
    "stream_options": "test_server_api", "response_format": "test_structured_outputs",
    "structured_outputs": "test_structured_outputs", "logit_bias": "here", "allowed_token_ids": "here",
    "min_tokens": "here", "truncate_prompt_tokens": "here", "max_tokens": "test_server_api",
    "logprobs": "test_server_api", "add_special_tokens": "here", "prompt_logprobs": "here",
    "skip_special_tokens": "test_special_tokens", "spaces_between_special_tokens": "test_special_tokens",
    # Hints with nothing to do here (no stored completions, one tier, automatic prefix caching):
    "user": "here", "metadata": "here", "service_tier": "here", "prompt_cache_key": "here",
    "prompt_cache_retention": "here", "prompt_cache_options": "here", "safety_identifier": "here",
}  # fmt: skip
IMPLEMENTED_CHAT = {
    **IMPLEMENTED_COMMON, "messages": "test_tool_calls", "max_completion_tokens": "test_server_api",
    "top_logprobs": "test_server_api", "tools": "test_tool_calls", "tool_choice": "test_tool_calls",
    "parallel_tool_calls": "test_tool_calls", "chat_template_kwargs": "here",
    "add_generation_prompt": "here", "continue_final_message": "here", "documents": "here",
    "reasoning_effort": "here", "include_reasoning": "test_reasoning_chat",
}  # fmt: skip
IMPLEMENTED_COMPLETION = {
    **IMPLEMENTED_COMMON,
    "prompt": "test_server_api",
    "echo": "here",
    "best_of": "here",
}


@pytest.mark.parametrize(
    ("model", "implemented", "refused", "openai_fields", "vllm_fields"),
    [
        (
            ChatCompletionRequest,
            IMPLEMENTED_CHAT,
            REFUSED_CHAT,
            chat_create_params.CompletionCreateParamsBase.__annotations__,
            VLLM_COMMON | VLLM_CHAT,
        ),
        (
            CompletionRequest,
            IMPLEMENTED_COMPLETION,
            REFUSED_COMPLETION,
            completion_create_params.CompletionCreateParamsBase.__annotations__,
            VLLM_COMMON | VLLM_COMPLETION,
        ),
    ],
)
def test_every_field_is_implemented_or_refused(
    model: Any,
    implemented: dict[str, str],
    refused: dict[str, Any],
    openai_fields: Any,
    vllm_fields: set[str],
) -> None:
    declared = set(model.model_fields)
    assert declared == set(implemented), "a declared field is not listed as implemented, or vice versa"
    assert not declared & set(refused), "a field is both declared and refused"
    known = declared | set(refused)
    assert set(openai_fields) - known == set(), "an OpenAI field would be silently ignored"
    assert vllm_fields - known == set(), "a vLLM field would be silently ignored"


@pytest.fixture
async def client(tiny_model_dir: pathlib.Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(tiny_model_dir) as c:
        yield c


@pytest.mark.parametrize(("path", "refused"), [("chat", REFUSED_CHAT), ("completions", REFUSED_COMPLETION)])
async def test_refused_fields_are_400s_naming_them(
    client: openai.AsyncOpenAI, path: str, refused: dict[str, Any]
) -> None:
    for name in refused:
        with pytest.raises(openai.BadRequestError) as info:
            body = {name: {"something": "asked"}}
            if path == "chat":
                await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=body)
            else:
                await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=body)
        assert f"`{name}` is not supported" in info.value.message
        assert info.value.body["param"] == name  # type: ignore[index]


async def test_neutral_values_hints_and_unknown_fields_are_accepted(
    client: openai.AsyncOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"use_beam_search": False, "no_such_field": 1, "modalities": ["text"]}
    with caplog.at_level(logging.WARNING):
        r = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=2,
            user="u",
            metadata={"k": "v"},
            service_tier="auto",
            prompt_cache_key="k",
            safety_identifier="s",
            store=False,
            extra_body=body,
        )
    assert r.choices[0].message.role == "assistant"
    assert "ignoring unknown request fields: no_such_field" in caplog.text


@pytest.fixture
def tokenizer(tiny_model_dir: pathlib.Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def test_logit_bias_allowed_token_ids_and_min_tokens(
    client: openai.AsyncOpenAI, tokenizer: Any
) -> None:
    c = await client.completions.create(
        model=MODEL, prompt="The fox", max_tokens=6, temperature=0, logit_bias={"300": 100}
    )
    assert c.choices[0].text == tokenizer.decode([300] * 6)
    allowed = [300, 301, 302]
    c = await client.completions.create(
        model=MODEL,
        prompt="The fox",
        max_tokens=8,
        seed=1,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed},
    )
    assert c.choices[0].logprobs and c.choices[0].logprobs.tokens
    assert set(tokenizer.encode(c.choices[0].text, add_special_tokens=False)) <= set(allowed)
    # EOS with a huge bias: ends at once unless min_tokens holds it back.
    eos = {str(tokenizer.eos_token_id): 100}
    c = await client.completions.create(model=MODEL, prompt="The fox", max_tokens=9, logit_bias=eos)
    assert c.usage and c.usage.completion_tokens == 1 and c.choices[0].finish_reason == "stop"
    c = await client.completions.create(
        model=MODEL, prompt="The fox", max_tokens=9, logit_bias=eos, extra_body={"min_tokens": 5}
    )
    assert c.usage and c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"999999": 1})


async def test_echo_best_of_truncation_and_special_tokens(client: openai.AsyncOpenAI, tokenizer: Any) -> None:
    c = await client.completions.create(model=MODEL, prompt="The fox", max_tokens=4, seed=3, echo=True)
    plain = await client.completions.create(model=MODEL, prompt="The fox", max_tokens=4, seed=3)
    assert c.choices[0].text == "The fox" + plain.choices[0].text
    stream = await client.completions.create(
        model=MODEL, prompt="The fox", max_tokens=4, seed=3, echo=True, stream=True
    )
    assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == c.choices[0].text

    best = await client.completions.create(
        model=MODEL, prompt="The fox", max_tokens=6, n=2, best_of=5, seed=4
    )
    assert [ch.index for ch in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage and best.usage.completion_tokens == 30  # best_of sequences are generated (and billed)
    scored = await client.completions.create(
        model=MODEL, prompt="The fox", max_tokens=6, n=5, seed=4, logprobs=0
    )
    totals = sorted(
        (sum(ch.logprobs.token_logprobs or []) for ch in scored.choices if ch.logprobs), reverse=True
    )
    best_scored = await client.completions.create(
        model=MODEL, prompt="The fox", max_tokens=6, n=2, best_of=5, seed=4, logprobs=0
    )
    chosen = [sum(ch.logprobs.token_logprobs or []) for ch in best_scored.choices if ch.logprobs]
    assert chosen == pytest.approx(totals[:2])

    long = "one two three four five six seven eight nine ten"
    cut = await client.completions.create(
        model=MODEL, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
    )
    assert cut.usage and cut.usage.prompt_tokens == 3
    bos = await client.completions.create(model=MODEL, prompt=long, max_tokens=1)
    no_bos = await client.completions.create(
        model=MODEL, prompt=long, max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert bos.usage and no_bos.usage and bos.usage.prompt_tokens == no_bos.usage.prompt_tokens + 1


async def test_echo_text_offsets_index_the_returned_text(client: openai.AsyncOpenAI, tokenizer: Any) -> None:
    """Each token's text_offset is where its text starts in the choice's text: the BOS the
    tokenizer adds takes no room there (it is no part of the echoed prompt, given as text or ids)."""
    given = "Hello world"
    ids = tokenizer.encode(given)
    assert ids[0] == tokenizer.bos_token_id
    for prompt in (given, ids):
        c = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
        )
        text, lp = c.choices[0].text, c.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        assert text.startswith(given) and lp.tokens[0] == tokenizer.bos_token
        # Each prompt token starts after the text of those before it; the first generated one
        # after the whole prompt.
        starts = [len(tokenizer.decode(ids[1:q])) for q in range(len(ids))]
        assert lp.text_offset[: len(ids) + 1] == [*starts, len(given)]
        for token, offset in zip(lp.tokens[1 : len(ids)], lp.text_offset[1 : len(ids)], strict=True):
            assert text[offset : offset + len(token)] == token


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Offsets never go back nor past the text, and a token whose text is whole (no U+FFFD: not a
    piece of a character's bytes) sits at its offset, unless it follows a piece (the model may
    write bytes that are no character: the text then shows them where the next token's text
    starts)."""
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for i, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        if "\ufffd" not in token and (i == 0 or "\ufffd" not in tokens[i - 1]):
            assert text[offset : offset + len(token)] == token, (token, offset)


async def test_text_offsets_after_characters_split_over_tokens(client: openai.AsyncOpenAI) -> None:
    # The byte-level tokenizer splits ü, ö and 日本 into byte tokens; decoded alone each is one
    # U+FFFD, a character the returned text does not hold: counting them shifted every later offset.
    given = "Grüße aus Köln, 日本語 ok"
    c = await client.completions.create(
        model=MODEL, prompt=given, max_tokens=12, temperature=0, echo=True, logprobs=1, seed=0
    )
    text, lp = c.choices[0].text, c.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert sum("\ufffd" in t for t in lp.tokens) >= 4
    assert lp.text_offset[:2] == [0, 0]  # the BOS the text does not hold takes no room
    _check_offsets(text, lp.tokens[1:], lp.text_offset[1:])
    tokens, offsets, streamed = [], [], ""
    stream = await client.completions.create(
        model=MODEL, prompt=given, max_tokens=12, temperature=0, logprobs=1, seed=0, stream=True
    )
    async for chunk in stream:
        choice = chunk.choices[0]
        streamed += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens or []
            offsets += choice.logprobs.text_offset or []
    assert streamed == text[len(given) :]
    _check_offsets(streamed, tokens, offsets)


async def test_template_fields_reach_the_chat_template(client: openai.AsyncOpenAI) -> None:
    async def prompt_tokens(messages: Any = ASK, **body: Any) -> int:
        r = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body=body
        )
        assert r.usage
        return r.usage.prompt_tokens

    base = await prompt_tokens()
    assert await prompt_tokens(add_generation_prompt=False) < base
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert await prompt_tokens(chat_template_kwargs={"tools": [tool]}) > base + 10
    partial: Any = [*ASK, {"role": "assistant", "content": "Once upon"}]
    closed = await prompt_tokens(partial, add_generation_prompt=False)
    assert await prompt_tokens(partial, add_generation_prompt=False, continue_final_message=True) < closed
    assert await prompt_tokens(add_special_tokens=True) == base + 1  # a second BOS
    req = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": ASK, "documents": [{"text": "d"}], "reasoning_effort": "low"}
    )
    kwargs = req.template_kwargs()
    assert kwargs["documents"] == [{"text": "d"}] and kwargs["reasoning_effort"] == "low"


@pytest.mark.parametrize("name", ["chat_template", "tokenize", "messages", "conversation"])
async def test_chat_template_kwargs_cannot_replace_the_template(
    client: openai.AsyncOpenAI, name: str
) -> None:
    # A template from the request would run its own loops on the server (and replace the model's,
    # which the top-level `chat_template` field may not); the renderer's own arguments are not
    # template variables.
    kwargs = {"chat_template_kwargs": {name: "{{ 'x' }}"}}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=kwargs)
    assert f"`{name}` is not supported" in info.value.message
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):  # /tokenize renders the same way
        await client.post("http://127.0.0.1/tokenize", cast_to=object, body={"messages": ASK, **kwargs})


async def test_echo_with_logprobs_scores_the_prompt_like_lm_eval(
    client: openai.AsyncOpenAI, tokenizer: Any
) -> None:
    prompt = "The quick brown fox jumps"
    ids = tokenizer.encode(prompt)
    c = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + 1  # every prompt token, then the generated one
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert c.choices[0].text.startswith(prompt)
    r = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    scored = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for q, entry in enumerate(scored[1:], start=1):
        assert entry[str(ids[q])]["logprob"] == pytest.approx(lp.token_logprobs[q], abs=1e-4)
        assert entry[str(ids[q])]["rank"] >= 1
    chat = await client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert chat.model_dump()["prompt_logprobs"][0] is None
    with pytest.raises(openai.BadRequestError, match="not streamed"):
        await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, stream=True
        )


async def test_an_unknown_reasoning_effort_is_refused_by_name(client: openai.AsyncOpenAI) -> None:
    """As OpenAI's API and the Responses API here: one of openai's `ReasoningEffort` values (any
    string reached the chat template before)."""
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_body={"reasoning_effort": "extreme"}
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "reasoning_effort"  # type: ignore[index]
