"""`corral demo-model DIR`: write a random-weight Hugging Face checkpoint with a local tokenizer."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)

# Kept in step with corral_engine.demo_model (not imported here: the engine side pulls in torch).
_PRESETS = ("tiny", "small", "llama3-8b")
_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen3-moe",
    "phi3",
    "gemma3",
    "granite",
    "olmo2",
    "gemma2",
)
# Encoder embedding models (corral_engine.demo_encoder): tiny only, in the sentence-transformers layout.
_ENCODER_ARCHS = ("bert", "xlm-roberta")
# Vision-language models (corral_engine.demo_llava, demo_qwen_vl): tiny only, float32.
_VISION_ARCHS = ("llava", "qwen2_vl", "qwen2_5_vl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument(
        "--preset",
        choices=_PRESETS,
        default="tiny",
        help=(
            "tiny: for tests (hidden 64, 2 layers); small: ~107M-parameter Llama for benchmarks; "
            "llama3-8b: Llama-3-8B's shapes (16 GB in bf16, sharded) for GPU benchmarks"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and tokenizer (default: 0)")
    parser.add_argument(
        "--arch",
        choices=(*_ARCHS, *_ENCODER_ARCHS, *_VISION_ARCHS),
        default="llama",
        help="model architecture; mixtral and qwen3-moe: 4 experts, 2 per token, tiny and small presets "
        "only; bert and xlm-roberta: encoder embedding models (mean and CLS pooling), tiny preset only; "
        "llava: a LLaVA-1.5 vision-language model (CLIP tower on 32x32 images, the tiny Llama, an "
        "<image> token, the processor files); qwen2_vl, qwen2_5_vl: Qwen2-VL and Qwen2.5-VL (the tiny "
        "Qwen2 with M-RoPE, a vision tower on 4x4 patches merged 2x2, any image size, the processor "
        "files); vision models: tiny preset only (default: llama)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the weights are drawn: cuda makes llama3-8b quick; each kind of device draws its "
        "own bytes (default: cpu)",
    )
    parser.add_argument(
        "--no-weights",
        action="store_true",
        help="the tokenizer and config only, in seconds and without torch: what `--simulate` reads",
    )
    parser.add_argument(
        "--quantization",
        choices=("fp8", "awq", "gptq", "w4a16"),
        default=None,
        help="fp8: write the same weights as a Hugging Face fine-grained FP8 checkpoint (the attention "
        "and MLP projections in float8_e4m3fn with a float32 scale per 128x128 block, as published "
        "-FP8 models are); awq, gptq, w4a16: as an int4 weight-only checkpoint (AutoAWQ GEMM, "
        "AutoGPTQ, compressed-tensors pack-quantized), round-to-nearest in groups of up to 128; "
        "dense architectures only",
    )
    parser.add_argument(
        "--embedding",
        choices=("lasttoken", "mean", "cls"),
        default=None,
        metavar="POOLING",
        help="write an embedding model, as Qwen3-Embedding ships: sentence-transformers files "
        "(modules.json, 1_Pooling/ with this pooling: lasttoken, mean or cls; 2_Normalize/), no LM head, "
        "the decoder's tensors under AutoModel's names; serve it with --runner pooling",
    )
    parser.add_argument(
        "--base-model-class",
        action="store_true",
        help="with --embedding, name the base-model class in config.json (Qwen3Model), which "
        "--runner auto serves as an embedding model",
    )
    parser.add_argument(
        "--reranker",
        action="store_true",
        help="with --arch bert or xlm-roberta: write a reranker (a cross-encoder, as "
        "cross-encoder/ms-marco-MiniLM-L-6-v2 and bge-reranker ship: *ForSequenceClassification with "
        "one label) instead of an embedding model; served with --runner pooling on /v1/score and /v1/rerank",
    )
    parser.add_argument(
        "--classifier",
        type=int,
        default=None,
        metavar="N",
        help="with --arch bert or xlm-roberta: write a sequence classifier of N labels (as sentiment "
        "and intent models ship: *ForSequenceClassification, id2label LABEL_0..) instead of an "
        "embedding model; served with --runner pooling on /classify",
    )
    parser.add_argument(
        "--token-classifier",
        action="store_true",
        help="with --classifier N: a token classifier instead (as NER models ship: "
        "*ForTokenClassification, N labels a token); served on /pooling (task token_classify)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument(
        "--lora-adapter",
        metavar="ADAPTER_DIR",
        help="instead of a checkpoint, write a PEFT LoRA adapter for the demo checkpoint already in "
        "DIR to ADAPTER_DIR: random non-zero A and B on every projection (a phi3 base's fused "
        "qkv_proj and gate_up_proj, as PEFT names them), drawn from --seed, so a request naming it "
        "generates differently from the base model",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=8, metavar="R", help="the adapter's rank (default: 8)"
    )


def run(args: argparse.Namespace) -> int:
    if args.lora_adapter is not None:
        return _write_adapter(args)
    if args.arch in _ENCODER_ARCHS:
        return _write_encoder(args)
    if args.arch in _VISION_ARCHS:
        return _write_vision(args)
    if args.reranker or args.classifier is not None or args.token_classifier:
        log.error(
            "%s: a classifier is an encoder (--arch %s), not --arch %s",
            "--reranker" if args.reranker else "--classifier",
            " or ".join(_ENCODER_ARCHS),
            args.arch,
        )
        return 2
    from corral_engine.demo_model import write_demo_model

    try:
        out = write_demo_model(
            args.dir,
            preset=args.preset,
            seed=args.seed,
            arch=args.arch,
            progress=not args.quiet,
            device=args.device,
            weights=not args.no_weights,
            quantization=args.quantization,
        )
        if args.embedding is not None:
            from corral_engine.demo_embedding import make_embedding_model

            make_embedding_model(out, args.embedding, base_model_class=args.base_model_class)
    except OSError as e:  # a file in the way, no permission, a full disk
        log.error("cannot write the checkpoint to %s: %s", args.dir, e)
        return 1
    except ValueError as e:  # a preset without that architecture (llama3-8b has no experts), fp8 experts
        log.error("%s", e)
        return 2
    what = "tokenizer and config" if args.no_weights else "checkpoint"
    if args.embedding is not None:
        what = f"{args.embedding}-pooling embedding {what}"
    if args.quantization:
        what = f"{args.quantization} {what}"
    log.info("wrote %s %s (%s, seed %d) to %s", args.preset, what, args.arch, args.seed, out)
    return 0


def _write_encoder(args: argparse.Namespace) -> int:
    """The tiny encoder checkpoint, an embedding model, a reranker or a classifier (the options for
    decoders' weights do not apply)."""
    if args.classifier is not None and (args.reranker or args.classifier < 1):
        log.error("--classifier N: N must be at least 1, and a reranker is --classifier 1 (not both)")
        return 2
    if args.token_classifier and args.classifier is None:
        log.error("--token-classifier needs --classifier N (its labels)")
        return 2
    refused = [
        flag
        for flag, is_set in (
            (f"--preset {args.preset}", args.preset != "tiny"),
            ("--no-weights", args.no_weights),
            (f"--quantization {args.quantization}", args.quantization is not None),
        )
        if is_set
    ]
    if refused:
        log.error(
            "--arch %s: %s not supported (the encoder demo is tiny, float32)", args.arch, ", ".join(refused)
        )
        return 2
    from corral_engine.demo_encoder import write_demo_encoder

    try:
        labels = args.classifier or 0
        out = write_demo_encoder(
            args.dir,
            arch=args.arch,
            seed=args.seed,
            is_reranker=args.reranker,
            num_labels=labels,
            is_token_classifier=args.token_classifier,
        )
    except OSError as e:
        log.error("cannot write the checkpoint to %s: %s", args.dir, e)
        return 1
    what = "reranker" if args.reranker else "encoder"
    if args.classifier:
        what = f"{args.classifier}-label {'token ' if args.token_classifier else ''}classifier"
    log.info("wrote tiny %s checkpoint (%s, seed %d) to %s", what, args.arch, args.seed, out)
    return 0


def _write_vision(args: argparse.Namespace) -> int:
    """The tiny LLaVA or Qwen-VL checkpoint (the options for text decoders' weights do not apply)."""
    refused = [
        flag
        for flag, is_set in (
            (f"--preset {args.preset}", args.preset != "tiny"),
            ("--no-weights", args.no_weights),
            (f"--quantization {args.quantization}", args.quantization is not None),
            (f"--embedding {args.embedding}", args.embedding is not None),
            ("--reranker", args.reranker),
        )
        if is_set
    ]
    if refused:
        log.error(
            "--arch %s: %s not supported (the vision demos are tiny, float32)", args.arch, ", ".join(refused)
        )
        return 2
    from corral_engine.demo_llava import write_llava_model
    from corral_engine.demo_qwen_vl import write_qwen_vl_model

    try:
        if args.arch == "llava":
            out = write_llava_model(args.dir, seed=args.seed)
        else:
            out = write_qwen_vl_model(args.dir, args.arch, seed=args.seed)
    except OSError as e:
        log.error("cannot write the checkpoint to %s: %s", args.dir, e)
        return 1
    log.info("wrote tiny %s checkpoint (seed %d) to %s", args.arch, args.seed, out)
    return 0


def _write_adapter(args: argparse.Namespace) -> int:
    from corral_engine.demo_adapter import write_demo_adapter

    if args.lora_rank < 1:
        log.error("--lora-rank must be at least 1")
        return 2
    try:
        out = write_demo_adapter(args.dir, args.lora_adapter, rank=args.lora_rank, seed=args.seed)
    except FileNotFoundError:
        log.error("%s holds no checkpoint: write one first with `corral demo-model %s`", args.dir, args.dir)
        return 1
    except OSError as e:
        log.error("cannot write the adapter to %s: %s", args.lora_adapter, e)
        return 1
    except ValueError as e:  # a mixture-of-experts checkpoint
        log.error("%s", e)
        return 2
    log.info("wrote a rank-%d LoRA adapter for %s (seed %d) to %s", args.lora_rank, args.dir, args.seed, out)
    return 0
