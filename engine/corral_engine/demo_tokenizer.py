"""The demo models' tokenizer: a byte-level BPE trained locally on a corpus generated from a seed.

Same seed, same tokenizer.json, byte for byte; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2 in this order
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
# Mistral's tool-call control tokens, special as in Mistral's own tokenizers (ids 3, 4, 5 of the
# mistral-arch demo models), so the text the engine returns leaves them out unless asked.
MISTRAL_TOOL_TOKENS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
IMAGE_TOKEN = "<image>"  # the llava demo's image placeholder: special, id 3
# The Qwen-VL demos' turn and vision tokens, special as in Qwen's tokenizers (ids 3 to 8).
QWEN_VL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_STYLE_SPECIALS = {"mistral": MISTRAL_TOOL_TOKENS, "llava": (IMAGE_TOKEN,), "qwen_vl": QWEN_VL_TOKENS}

# Role-tagged turns; an assistant turn ends with eos so generation stops at the end of a reply.
# With `tools`, a system turn lists them and asks for Hermes-style calls (the format of Qwen 2.5/3 and
# NousResearch Hermes: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`); an assistant turn's
# `tool_calls` are written back in that format, and a `tool` turn holds a result. Without tools the
# rendering is what it always was.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    '{{- \'<|system|>\\nCall a function by replying <tool_call>{"name": NAME, "arguments": ARGS}'
    "</tool_call>.\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>' + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# The llava demo's: a message's content is a string or a list of parts; each image part becomes one
# `<image>` (the processor or the engine expands it to the image's placeholder tokens).
LLAVA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<image>\\n' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# The Qwen-VL demos' (Qwen2-VL's layout): ChatML turns, a default system turn, and each image part
# as <|vision_start|><|image_pad|><|vision_end|> (a video part likewise with <|video_pad|>).
QWEN_VL_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Fixed English text so common words get their own tokens and demos read naturally.
_ENGLISH = """
The quick brown fox jumps over the lazy dog. A corral is a pen for keeping animals together,
and this project keeps a herd of language models together on a cluster of machines.
Every request arrives at the gateway, waits in a queue, and is sent to the replica with the most room.
The engine reads the prompt, fills its cache block by block, and writes one token at a time.
When memory runs short it pauses the newest request and picks it up again later.
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past nine.
One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 65536.
Please write a short story about a cat who learns to read. Once upon a time there was a small cat.
She found a book in the garden and opened it. The letters danced, and slowly they began to make sense.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n
{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
Summer, autumn, winter, spring. North, south, east, west. Red, green, blue, yellow, black, white.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber, stra\u00dfe.
\u4f60\u597d\uff0c\u4e16\u754c\u3002 \u3053\u3093\u306b\u3061\u306f\u3002 \U0001f600 \U0001f680 \u2764\ufe0f
"""

# The pre-tokenizer split of transformers' Qwen2Tokenizer (a behaviour, restated to match it).
_QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ENGLISH_REPEATS = 50  # weight the fixed text so its common words become tokens even in tiny vocabularies


# Pseudo-word parts; repeated "" entries make empty onsets/codas more likely.
_ONSETS = [
    "",
    *"bcdfghjklmnprstvwz",
    *["br", "ch", "cl", "dr", "fl", "gr", "kr", "pl", "pr", "sh", "sk", "st", "th"],
]
_VOWELS = [*"aeiouy", *["ai", "ea", "ee", "ie", "oa", "oo", "ou"]]
_CODAS = ["", "", "", *"nrstlmx", *["nd", "ng", "st", "rt", "ck", "sh"]]
_PUNCT = [*"...,,!?;:"]


def synthetic_corpus(seed: int, num_words: int, lexicon_size: int) -> Iterator[str]:
    """Deterministic training text: fixed English plus Zipf-distributed seeded pseudo-words."""
    rng = random.Random(seed)
    for _ in range(_ENGLISH_REPEATS):
        yield from _ENGLISH.strip().splitlines()
    lexicon: list[str] = []
    seen: set[str] = set()
    while len(lexicon) < lexicon_size:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        if word not in seen:
            seen.add(word)
            lexicon.append(word)
    weights = [1.0 / (rank + 1) for rank in range(lexicon_size)]
    words = rng.choices(lexicon, weights=weights, k=num_words)
    # Every lexicon word at least twice, so the larger vocabularies have enough distinct merges.
    words += lexicon + lexicon
    rng.shuffle(words)
    line: list[str] = []
    for i, word in enumerate(words):
        if not line:
            word = word.capitalize()
        line.append(word)
        if rng.random() < 0.08:
            line[-1] += rng.choice(_PUNCT)
        if rng.random() < 0.02:
            line.append(str(rng.randrange(10_000)))
        if len(line) >= 12 or i == len(words) - 1:
            yield " ".join(line)
            line = []


@contextlib.contextmanager
def single_threaded_tokenizers() -> Iterator[None]:
    # tokenizers reads this on each call; one thread keeps training independent of scheduling.
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def tokenizer_style(arch: str) -> str:
    """Qwen checkpoints load through transformers' Qwen2Tokenizer, which rebuilds a Qwen pipeline
    (NFC, Qwen split regex, no BOS); Qwen-arch demo models use that pipeline so every loader agrees.
    Mistral's is Llama's plus its tool-call control tokens."""
    if arch in ("qwen2", "qwen3"):
        return "qwen"
    return arch if arch in _STYLE_SPECIALS else "llama"


def train_tokenizer(
    seed: int, vocab_size: int, num_words: int, lexicon_size: int, style: str = "llama"
) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` entries (specials included)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    if style in ("qwen", "qwen_vl"):
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[*SPECIAL_TOKENS, *_STYLE_SPECIALS.get(style, ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with single_threaded_tokenizers():
        tok.train_from_iterator(synthetic_corpus(seed, num_words, lexicon_size), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer training reached {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    if style not in ("qwen", "qwen_vl"):
        # Like Llama: encoding adds BOS (the chat template writes it itself: render, then encode
        # without special tokens).
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
        )
    return tok


def tokenizer_config(max_length: int, style: str) -> dict[str, Any]:
    is_qwen = style in ("qwen", "qwen_vl")
    templates = {"llava": LLAVA_CHAT_TEMPLATE, "qwen_vl": QWEN_VL_CHAT_TEMPLATE}
    return {
        "tokenizer_class": "Qwen2Tokenizer" if is_qwen else "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,  # byte-level: every input is representable
        "add_bos_token": not is_qwen,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": templates.get(style, CHAT_TEMPLATE),
    }
