"""Special tokens in returned text: vLLM's skip_special_tokens (default true) and
spaces_between_special_tokens, through the server on the engine in-process and in its own core
process; the special token that ended a reply (EOS) stays out unless include_stop_str_in_output.
With `--tool-call-parser mistral`, a reply's `[TOOL_CALLS]` and `[ARGS]` (special tokens in Mistral's
tokenizers, and in the mistral demo model's) reach the parser, so calls after content are found,
whole and streamed, and no other special token shows in `content`."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import openai
import pytest
from corral_engine.demo_model import write_demo_model
from corral_engine.demo_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, MISTRAL_TOOL_TOKENS
from corral_engine.sampling_params import SamplingError, SamplingParams
from corral_engine.server import create_app
from corral_engine.settings import EngineSettings
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import Fitted, Profile
from corral_engine.sim.tokenizer import LightTokenizer
from corral_engine.tokenizer import IncrementalDetokenizer, load_tokenizer, special_tokens

from tests.server.real_engine import openai_client

TOOL_CALLS_ID = 3  # [TOOL_CALLS] in the mistral demo tokenizer
PROFILE = Profile("test", Fitted((1e-4, 0.0, 0.0, 0.0, 0.0)), num_kv_blocks=256, max_model_len=1024)
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# The simulator's reply repeats its prompt's tokens, so this user turn is what the reply says: content,
# then a call after the marker. The stop string ends the reply where the next turn would begin.
SAID = 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
CHAT: Any = {"messages": [{"role": "user", "content": SAID}], "temperature": 0, "stop": ["<|assistant|>"]}


def test_the_mistral_demo_tokenizer_has_the_tool_tokens_as_special(
    tiny_model_dirs: Mapping[str, pathlib.Path],
) -> None:
    tokenizer = load_tokenizer(tiny_model_dirs["mistral"])
    assert tokenizer.convert_ids_to_tokens([3, 4, 5]) == list(MISTRAL_TOOL_TOKENS)
    ids = tokenizer.encode("a [TOOL_CALLS]b", add_special_tokens=False)
    assert TOOL_CALLS_ID in ids and tokenizer.decode(ids, skip_special_tokens=True) == "a b"


def test_hidden_ids_leave_out_those_special_tokens_and_show_the_others(
    tiny_model_dirs: Mapping[str, pathlib.Path],
) -> None:
    tokenizer = load_tokenizer(tiny_model_dirs["mistral"])
    output = [BOS_TOKEN_ID, *tokenizer.encode("Sure.[TOOL_CALLS]f[ARGS]{}", add_special_tokens=False)]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, hidden_ids=frozenset({0, 1, 2}))
    for token_id in output:
        detok.add_token(token_id)
    detok.flush()
    assert detok.take_delta(True) == "Sure.[TOOL_CALLS]f[ARGS]{}"


@pytest.fixture(params=["0", "1"], ids=["in-process", "core-process"])
async def client(
    request: pytest.FixtureRequest, tiny_model_dirs: Mapping[str, pathlib.Path]
) -> AsyncIterator[openai.AsyncOpenAI]:
    settings = EngineSettings(engine_process=request.param)
    async with openai_client(tiny_model_dirs["mistral"], settings=settings) as c:
        yield c


async def _text(client: openai.AsyncOpenAI, allowed: list[int], **extra: Any) -> str:
    r = await client.completions.create(
        model="tiny-mistral",
        prompt="hi",
        max_tokens=4,
        temperature=0,
        extra_body={"allowed_token_ids": allowed, **extra},
    )
    return r.choices[0].text


async def test_skip_special_tokens_false_shows_them_but_not_the_eos_that_ended_the_reply(
    client: openai.AsyncOpenAI,
) -> None:
    specials = [BOS_TOKEN_ID, TOOL_CALLS_ID]
    assert await _text(client, specials) == ""
    shown = await _text(client, specials, skip_special_tokens=False)
    assert len(shown) > 4 and shown.replace("<s>", "").replace("[TOOL_CALLS]", "") == ""
    assert await _text(client, specials, spaces_between_special_tokens=False) == ""
    # A reply ended by EOS: its text leaves the EOS out, unless asked for the stop's text.
    assert await _text(client, [EOS_TOKEN_ID], skip_special_tokens=False) == ""
    eos = await _text(client, [EOS_TOKEN_ID], skip_special_tokens=False, include_stop_str_in_output=True)
    assert eos == "</s>"


async def test_special_token_fields_must_be_booleans(client: openai.AsyncOpenAI) -> None:
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="tiny-mistral", messages=[{"role": "user", "content": "hi"}], extra_body={name: "no"}
            )
        assert info.value.body["param"] == name  # type: ignore[index]


def test_sampling_params_name_a_special_token_field_of_the_wrong_type() -> None:
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(SamplingError) as info:
            SamplingParams(**{name: "no"})
        assert info.value.param == name and name in str(info.value)
    assert SamplingParams().skip_special_tokens and SamplingParams().spaces_between_special_tokens


@pytest.fixture(scope="module")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The mistral demo model's tokenizer and config, all the simulator reads."""
    return write_demo_model(tmp_path_factory.mktemp("models") / "sim-mistral", arch="mistral", weights=False)


async def _sim_client(model_dir: pathlib.Path, parser: str | None) -> AsyncIterator[httpx.AsyncClient]:
    [engine] = build_engines(ReplicaSpec(PROFILE, model_dir, "sim"), 1)
    app = create_app(engine, tool_call_parser=parser)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            yield c


@pytest.fixture
async def mistral_sim(sim_model_dir: pathlib.Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async for http in _sim_client(sim_model_dir, "mistral"):
        yield openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http, max_retries=0)


async def test_mistral_calls_after_content_are_found_whole_and_streamed(
    mistral_sim: openai.AsyncOpenAI,
) -> None:
    whole = await mistral_sim.chat.completions.create(model="sim", tools=TOOLS, max_tokens=300, **CHAT)
    message = whole.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert whole.choices[0].finish_reason == "tool_calls"
    content = message.content or ""
    assert content.endswith("<|user|>\nSure. ")
    assert not any(t in content for t in ("<s>", "</s>", "[TOOL_CALLS]", "[ARGS]"))
    stream = await mistral_sim.chat.completions.create(
        model="sim", tools=TOOLS, max_tokens=300, stream=True, **CHAT
    )
    streamed, names, arguments = "", [], ""
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        streamed += (delta and delta.content) or ""
        for call in (delta and delta.tool_calls) or []:
            names += [call.function.name] if call.function and call.function.name else []
            arguments += (call.function and call.function.arguments) or ""
    assert (streamed, names, arguments) == (content, ["get_weather"], '{"city": "Paris"}')


async def test_without_tools_the_markers_stay_out_of_the_text(mistral_sim: openai.AsyncOpenAI) -> None:
    r = await mistral_sim.chat.completions.create(model="sim", max_tokens=300, **CHAT)
    content = r.choices[0].message.content or ""
    assert content.endswith('<|user|>\nSure. get_weather{"city": "Paris"}\n')


@pytest.fixture
async def sim(sim_model_dir: pathlib.Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async for http in _sim_client(sim_model_dir, None):
        yield openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http, max_retries=0)


async def test_responses_take_the_special_token_fields_as_chat_does(sim: openai.AsyncOpenAI) -> None:
    """The simulator's reply repeats its prompt, BOS included: shown only when asked, whole and
    streamed; a value of the wrong type is a 400 naming the field."""
    ask: Any = {"model": "sim", "input": "hi", "max_output_tokens": 6, "temperature": 0}
    hidden = await sim.responses.create(**ask)
    shown = await sim.responses.create(**ask, extra_body={"skip_special_tokens": False})
    assert "<s>" not in hidden.output_text and shown.output_text == "<s>" + hidden.output_text
    stream = await sim.responses.create(**ask, stream=True, extra_body={"skip_special_tokens": False})
    deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == shown.output_text
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            await sim.responses.create(**ask, extra_body={name: "no"})
        assert info.value.body["param"] == name  # type: ignore[index]


async def test_echo_of_a_token_prompt_follows_skip_special_tokens(
    sim: openai.AsyncOpenAI, sim_model_dir: pathlib.Path
) -> None:
    """The echoed prompt is decoded as the completion's text is: its BOS shown only when asked."""
    ids = [BOS_TOKEN_ID, *load_tokenizer(sim_model_dir).encode("hi there", add_special_tokens=False)]
    for skip, echoed in ((True, "hi there"), (False, "<s>hi there")):
        c = await sim.completions.create(
            model="sim", prompt=ids, max_tokens=1, echo=True, extra_body={"skip_special_tokens": skip}
        )
        assert c.choices[0].text.startswith(echoed) and c.choices[0].text[len(echoed) :] in ("", "<s>")


class SlowStyleTokenizer(LightTokenizer):
    """The simulator's tokenizer decoding as transformers 4's slow tokenizers do: special tokens
    spaced apart unless `spaces_between_special_tokens` is false (fast ones, and transformers 5's,
    ignore it, so no tokenizer here shows the difference)."""

    clean_up_tokenization_spaces = True  # no direct Rust decode: every decode comes here

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True
    ) -> str:
        specials = set(special_tokens(self).values())
        pieces: list[list[int]] = []
        for token_id in ids:
            if token_id in specials:
                pieces += [[token_id]] if not skip_special_tokens else []
                pieces.append([])
            elif pieces and pieces[-1]:
                pieces[-1].append(token_id)
            else:
                pieces.append([token_id])
        texts = [super(SlowStyleTokenizer, self).decode(p) for p in pieces if p]
        return (" " if spaces_between_special_tokens else "").join(texts)


async def test_text_offsets_index_the_text_written_without_spaces_between_special_tokens(
    sim_model_dir: pathlib.Path,
) -> None:
    """With spaces_between_special_tokens false the text leaves out the spaces a slow tokenizer
    puts around special tokens; each token's text_offset is where it stands in that text, whole
    and streamed. The simulator's reply repeats its prompt, here special tokens among words."""
    [engine] = build_engines(ReplicaSpec(PROFILE, sim_model_dir, "sim"), 1)
    tokenizer = SlowStyleTokenizer(sim_model_dir)
    engine.tokenizer = engine.engine.tokenizer = engine.engine.output_processor.tokenizer = tokenizer
    words = tokenizer.encode("hi there", add_special_tokens=False)
    prompt = [*words, TOOL_CALLS_ID, TOOL_CALLS_ID, *words]
    app = create_app(engine)
    ask: Any = {"model": "sim", "prompt": prompt, "max_tokens": len(prompt), "logprobs": 0}
    body: Any = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http)
            whole = await client.completions.create(**ask, extra_body=body)
            chunks = [c async for c in await client.completions.create(**ask, stream=True, extra_body=body)]
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert text == "hi there[TOOL_CALLS][TOOL_CALLS]hi there"
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert text[offset : offset + len(token)] == token, (token, offset)
    streamed = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []]
    assert streamed == lp.text_offset
