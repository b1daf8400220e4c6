"""The chat template an engine renders conversations with: --chat-template read (a file, or the
template itself, as vLLM takes it) and compiled at start-up, so a bad one stops the engine there
rather than failing every chat request (light; jinja2 only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from corral_engine.args import ArgumentError, cli_flag

# vLLM's rule: a value holding any of these is a template, not a path.
_TEMPLATE_MARKS = ("{", "}", "\n")
_HOW_TO_GIVE = f"give one with {cli_flag('chat_template')} (a file, or the Jinja template itself)"
NO_TEMPLATE_MESSAGE = f"The model has no chat template, so chat requests are refused; {_HOW_TO_GIVE}."


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a template of its own (tokenizer_config.json's, or a
    chat_template.jinja beside it)."""
    return getattr(tokenizer, "chat_template", None) is not None


def load_chat_template(value: str | None) -> str | None:
    """--chat-template's value as a template: a file's text, or the value itself where it holds
    template marks; checked to compile. None (not given) stays None: the tokenizer's is used.
    Raises ArgumentError naming the flag."""
    if value is None:
        return None
    flag = cli_flag("chat_template")
    # os.path's answers False for a name the system refuses (a long template is too long a name).
    if os.path.isfile(value):
        try:
            template = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArgumentError(f"{flag}: cannot read {value}: {e}") from None
    elif any(mark in value for mark in _TEMPLATE_MARKS):
        template = value
    else:
        raise ArgumentError(f"{flag}: no such file: {value} (give a file, or the Jinja template itself)")
    _check_compiles(template, flag)
    return template


def _check_compiles(template: str, flag: str) -> None:
    """Compiled in the environment it renders in (an unknown filter is caught too)."""
    from jinja2 import TemplateSyntaxError

    try:
        template_environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ArgumentError(f"{flag}: the template does not compile: {e.message} (line {e.lineno})") from None


def template_environment() -> Any:
    """The environment transformers renders chat templates in: the sandbox, trim_blocks and
    lstrip_blocks, loop controls, `{% generation %}` blocks, a `tojson` that returns plain text
    (jinja's own returns HTML-escaped markup, which turns the quotes of any string it is joined
    with into entities), raise_exception and strftime_now."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(date_format)


def _generation_tag() -> type[Any]:
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens
    for training masks), read here as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja declares it a plain set attribute)

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationTag
