"""Every request field OpenAI or vLLM defines is honoured or refused, never silently dropped.

The request models declare each such field. Those the engine does not implement are typed `Any`
and listed here with the values that ask for nothing (a client library may send those), so any
other value is a 400 naming the field and saying why. Fields no one defines are ignored, as vLLM
does, with a warning naming them (never their values).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from corral_engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    neutral: tuple[Any, ...] = (None,)  # values that ask for nothing, so they are accepted


_NO_BEAMS = "beam search is not implemented"
_NO_MM = "this engine serves text-only models"
REFUSED_COMMON: dict[str, Refused] = {
    "use_beam_search": Refused(_NO_BEAMS, (None, False)),
    "length_penalty": Refused(_NO_BEAMS, (None, 1, 1.0)),
    "bad_words": Refused("bad_words is not implemented; logit_bias can ban single tokens", (None, [])),
    "logits_processors": Refused("custom logits processors are not supported", (None, [])),
    "return_tokens_as_token_ids": Refused("tokens are returned as text", (None, False)),
    "return_token_ids": Refused("token ids are not returned", (None, False)),
    "priority": Refused("requests are served first come, first served", (None, 0)),
    "request_id": Refused("the server assigns request ids"),
    "cache_salt": Refused("the prefix cache has no per-tenant salt"),
    "kv_transfer_params": Refused("disaggregated prefill is not supported"),
    "vllm_xargs": Refused("no extension takes extra arguments"),
    "mm_processor_kwargs": Refused(_NO_MM),
    "store": Refused("completions are not stored", (None, False)),
    # vLLM's old guided decoding fields (removed in vLLM 0.12): refused so a constraint is never lost.
    **{
        name: Refused("use structured_outputs")
        for name in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_decoding_backend",
            "guided_whitespace_pattern",
            "structural_tag",
        )
    },
}
REFUSED_CHAT: dict[str, Refused] = {
    **REFUSED_COMMON,
    "audio": Refused(_NO_MM),
    "modalities": Refused(_NO_MM, (None, ["text"])),
    "prediction": Refused("predicted outputs are not supported"),
    "web_search_options": Refused("web search is not available"),
    "functions": Refused("functions is deprecated and not supported: use tools", (None, [])),
    "function_call": Refused("function_call is deprecated and not supported: use tool_choice"),
    "verbosity": Refused("verbosity is for OpenAI's reasoning models"),
    "moderation": Refused("moderation is not available"),
    "chat_template": Refused("the chat template is the model's; a request cannot replace it"),
    "echo": Refused("echo on chat is not supported", (None, False)),
}
REFUSED_COMPLETION: dict[str, Refused] = {
    **REFUSED_COMMON,
    "suffix": Refused("this model's tokenizer has no fill-in-the-middle tokens"),
    "prompt_embeds": Refused("prompts are text or token ids"),
}


def check_fields(extra: dict[str, Any], refused: dict[str, Refused]) -> None:
    """`extra`: the body's fields the model does not declare. Raise InvalidRequestError for the
    first refused one given a value that asks for something; log the names of unknown ones."""
    for name, value in extra.items():
        rule = refused.get(name)
        if rule is not None and not any(value == ok and type(value) is type(ok) for ok in rule.neutral):
            raise InvalidRequestError(f"`{name}` is not supported: {rule.reason}.", name)
    unknown = sorted(name for name in extra if name not in refused)
    if unknown:
        logger.warning("ignoring unknown request fields: %s", ", ".join(unknown)[:500])
