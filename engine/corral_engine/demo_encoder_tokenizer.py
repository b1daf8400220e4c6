"""The encoder demo models' tokenizers, built from the demo corpus (demo_tokenizer.synthetic_corpus):
BERT's lower-casing WordPiece adding [CLS] ... [SEP], XLM-RoBERTa's sentencepiece-style Unigram
adding <s> ... </s>. Same seed, same tokenizer.json."""

from __future__ import annotations

import collections
import json
from typing import Any

from corral_engine.demo_tokenizer import single_threaded_tokenizers, synthetic_corpus

# BERT's WordPiece specials (ids 0-4 here) and XLM-RoBERTa's sentencepiece ids (<mask> last).
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
XLMR_MASK = "<mask>"
_NUM_CORPUS_WORDS, _LEXICON_SIZE = 20_000, 3_000
_SCORE_DECIMALS = 8  # of a Unigram piece's log probability (the trainer's last bits vary run to run)
_MAX_SUFFIX_CHARS = 4  # the longest word ending a WordPiece vocabulary holds as a ##piece


def train_encoder_tokenizer(arch: str, seed: int, vocab_size: int) -> Any:
    """`arch`'s tokenizer: a `tokenizers.Tokenizer` of exactly `vocab_size` entries."""
    tok = _wordpiece(seed, vocab_size) if arch == "bert" else _unigram(seed, vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def _wordpiece(seed: int, vocab_size: int) -> Any:
    """Uncased BERT's pipeline over a vocabulary counted here (the WordPiece trainer breaks ties in
    hash order, so its vocabulary differs run to run): every character the corpus has, alone and
    as a ##continuation, then the most frequent whole words and word endings."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)  # accents stripped, CJK split
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: collections.Counter[str] = collections.Counter()
    chars: set[str] = set()
    for line in synthetic_corpus(seed, _NUM_CORPUS_WORDS, _LEXICON_SIZE):
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line)):
            chars.update(word)
            counts[word] += 1
            for n in range(2, min(_MAX_SUFFIX_CHARS, len(word) - 1) + 1):
                counts["##" + word[-n:]] += 1
    vocab = [*BERT_SPECIALS, *sorted(chars), *sorted("##" + c for c in chars)]
    ranked = sorted((c for c in counts.items() if c[0] not in vocab), key=lambda c: (-c[1], c[0]))
    vocab += [piece for piece, _ in ranked[: vocab_size - len(vocab)]]
    tok = Tokenizer(models.WordPiece({piece: i for i, piece in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoders.WordPiece()
    cls, sep = BERT_SPECIALS[2], BERT_SPECIALS[3]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, 2), (sep, 3)],
    )
    tok.add_special_tokens(list(BERT_SPECIALS))  # kept whole in text, skipped when decoding
    return tok


def _unigram(seed: int, vocab_size: int) -> Any:
    """XLM-RoBERTa's layout (NFKC, a ▁ before each word, <mask> the last id) on a trained Unigram."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size - 1,  # <mask> is added after training
        special_tokens=list(XLMR_SPECIALS),
        unk_token="<unk>",
        show_progress=False,
    )
    with single_threaded_tokenizers():
        tok.train_from_iterator(synthetic_corpus(seed, _NUM_CORPUS_WORDS, _LEXICON_SIZE), trainer=trainer)
    tok = _canonical_unigram(tok)
    tok.add_special_tokens([XLMR_MASK])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return tok


def _canonical_unigram(tok: Any) -> Any:
    """The trained Unigram made the same on every run: the trainer sums in hash-map order (a
    score's last bits vary) and gives the characters it adds back at the end (those pruned, below
    every learned piece) its lowest scores in hash-set order. Here those characters take the same
    scores in character order, and every piece is listed by its rounded score."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    specials = data["model"]["vocab"][: len(XLMR_SPECIALS)]  # ids 0-3, kept where they are
    pieces = [(p, round(score, _SCORE_DECIMALS)) for p, score in data["model"]["vocab"][len(specials) :]]
    lowest_learned = min(score for p, score in pieces if len(p) > 1)
    added = [(p, score) for p, score in pieces if len(p) == 1 and score < lowest_learned]
    learned = sorted(set(pieces) - set(added), key=lambda p: (-p[1], p[0]))
    scores = sorted((score for _, score in added), reverse=True)
    data["model"]["vocab"] = specials + learned + list(zip(sorted(p for p, _ in added), scores, strict=True))
    return Tokenizer.from_str(json.dumps(data))


def encoder_tokenizer_config(arch: str, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the class real checkpoints name, and the special tokens."""
    if arch == "bert":
        pad, unk, cls, sep, mask = BERT_SPECIALS
        extra: dict[str, Any] = {"tokenizer_class": "BertTokenizer", "do_lower_case": True}
    else:
        cls, pad, sep, unk = XLMR_SPECIALS
        mask = XLMR_MASK
        extra = {"tokenizer_class": "XLMRobertaTokenizer", "bos_token": cls, "eos_token": sep}
    return {
        **extra,
        "cls_token": cls,
        "sep_token": sep,
        "pad_token": pad,
        "unk_token": unk,
        "mask_token": mask,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
