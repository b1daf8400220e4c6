"""`corral bench`: load-test any OpenAI-compatible endpoint and report throughput, TTFT, TPOT, ITL, E2E."""

from __future__ import annotations

import argparse
import functools
import logging
import os
from typing import Any

from corral_cli.flags import non_negative_float, non_negative_int, positive_float, positive_int

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    target.add_argument("--model", help="model name to request (default: the server's first model)")
    target.add_argument(
        "--endpoint-type",
        choices=("completions", "chat", "embeddings", "rerank"),
        default="completions",
        help="completions: /v1/completions with token-id prompts (exact input lengths); "
        "chat: /v1/chat/completions with text prompts; embeddings: /v1/embeddings (token ids, or "
        "text with --tokenizer); rerank: /v1/rerank, a query and its documents (text)",
    )
    target.add_argument(
        "--embedding-batch-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="embeddings: inputs per request; rerank: documents per query (default: 1)",
    )
    target.add_argument(
        "--embedding-encoding",
        choices=("float", "base64"),
        default="float",
        help="embeddings' encoding_format: float (the API's default) or base64 (what OpenAI's "
        "Python client asks for)",
    )
    target.add_argument(
        "--metrics-url", help="Prometheus endpoint to read preemptions from (default: BASE_URL/metrics)"
    )
    target.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    target.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="seconds a request may wait for its next bytes before it fails",
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get("CORRAL_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $CORRAL_API_KEY, else none)",
    )
    target.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="an extra HTTP header for every request (repeatable), e.g. 'x-corral-priority: 5'",
    )

    work = parser.add_argument_group("workload")
    work.add_argument("--dataset", help="ShareGPT JSON or JSONL file (default: random prompts)")
    work.add_argument("--tokenizer", help="directory with tokenizer.json, for exact token counts")
    work.add_argument(
        "--num-prompts", type=positive_int, default=100, help="requests per run (each rate of a sweep)"
    )
    work.add_argument("--random-input-len", type=positive_int, default=128, help="prompt tokens")
    work.add_argument("--random-output-len", type=positive_int, default=128, help="tokens to generate")
    work.add_argument("--random-range-ratio", type=float, default=0.0, help="length spread, in [0, 1)")
    work.add_argument(
        "--random-vocab-size",
        type=positive_int,
        help="token ids for random prompts are drawn from 3 to below it (default: 259, ids any byte-level "
        "vocabulary has; with --tokenizer, its vocabulary less its special tokens)",
    )
    work.add_argument(
        "--random-dist",
        choices=("uniform", "lognormal"),
        default="uniform",
        help="lognormal: the lengths above are medians, with --random-sigma, clipped to "
        "[--random-min-len, --max-prompt-len / --max-output-len]",
    )
    work.add_argument(
        "--random-sigma", type=positive_float, default=1.0, help="log-normal spread (default: 1.0)"
    )
    work.add_argument(
        "--random-min-len", type=positive_int, default=1, help="log-normal lower clip (default: 1)"
    )
    work.add_argument(
        "--max-prompt-len", type=positive_int, default=1024, help="dataset filter / log-normal clip (tokens)"
    )
    work.add_argument("--max-output-len", type=positive_int, default=1024, help="log-normal clip (tokens)")
    work.add_argument(
        "--max-total-len", type=positive_int, default=2048, help="dataset filter: prompt + output"
    )
    work.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds prompts, lengths, dataset sampling and arrival times: the same seed, the same workload",
    )
    work.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested lengths")
    work.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="sampling temperature sent with each request",
    )
    work.add_argument(
        "--max-tokens-cap",
        type=positive_int,
        metavar="N",
        help="send max_tokens=N and end each stream once its sampled output length has arrived, so "
        "the server does not know output lengths in advance (lengths over N stop at N)",
    )
    work.add_argument(
        "--random-images",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="chat: each request carries N images of its own (JPEG noise, data: URLs), for "
        "vision-language models (default: 0)",
    )
    work.add_argument(
        "--random-image-size",
        default="336x336",
        metavar="WxH",
        help="the random images' size in pixels (default: 336x336, LLaVA-1.5's input)",
    )

    work.add_argument(
        "--no-stream",
        action="store_true",
        help="non-streamed requests (one JSON response each): time to first token is then the whole "
        "request's, and there are no inter-token gaps",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", default="inf", help="requests/s (Poisson); 'inf' = all at once; '1,2,inf' = a sweep"
    )
    load.add_argument(
        "--burstiness", type=positive_float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier"
    )
    load.add_argument("--max-concurrency", type=positive_int, help="cap on requests in flight")
    load.add_argument(
        "--warmup-requests",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="requests sent all at once (at most --max-concurrency in flight) and waited for before the "
        "first run, counted in no figure: a fresh server's first requests pay its start-up (default: 0)",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--result-file", help="write the results as JSON here (missing folders are created)")
    out.add_argument(
        "--plot",
        help="FILE.png (or .svg, .pdf, ...): latency distributions, or throughput and latency "
        "against rate for a sweep",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from corral_cli.bench.runner import BenchError, run_async

    try:
        return run_async(_bench(args))
    except BenchError as e:
        log.error("%s", e)
        return 1


def request_headers(api_key: str | None, header_flags: list[str]) -> dict[str, str]:
    """The headers every request carries; ValueError on a --header without a name and a colon."""
    headers: dict[str, str] = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    for flag in header_flags:
        name, sep, value = flag.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header expects NAME:VALUE, got {flag!r}")
        headers[name.strip()] = value.strip()
    return headers


def _load_workloads(args: argparse.Namespace, num_runs: int) -> tuple[list[list[Any]], list[Any], str]:
    """The requests for each run, the warm-up's (`--warmup-requests`), and where their token
    lengths come from.

    Random workloads get fresh prompts of the same lengths per run, so a sweep's later runs do not
    hit the server's prefix cache with an earlier run's prompts, and the warm-up gets prompts no run
    sends; dataset prompts repeat as they are (the warm-up sends the dataset's first ones).
    Embeddings and rerank requests take `--embedding-batch-size` prompts each (rerank: one more,
    its query). `--random-images` gives each chat request images of its own, fresh per run too.
    """
    from corral_cli.bench import images, pooling, workload
    from corral_cli.bench.runner import BenchError, is_generation

    is_pooling = not is_generation(args.endpoint_type)
    per = pooling.inputs_per_request(args.endpoint_type, args.embedding_batch_size) if is_pooling else 1
    try:
        tokenizer = workload.HFTokenizer(args.tokenizer) if args.tokenizer else None
        runs, warmup, lengths_from = _sample_prompts(args, num_runs, per, tokenizer)
        if args.random_images:
            attach = functools.partial(
                images.with_images,
                num_images=args.random_images,
                size=images.parse_size(args.random_image_size),
                seed=args.seed,
            )
            runs = [attach(r, variant=i) for i, r in enumerate(runs)]
            warmup = attach(warmup, variant=len(runs))  # images no run sends
        if is_pooling:
            group = functools.partial(
                pooling.group_inputs, endpoint_type=args.endpoint_type, batch_size=args.embedding_batch_size
            )
            return [group(r) for r in runs], group(warmup), lengths_from
        return runs, warmup, lengths_from
    except ValueError as e:
        raise BenchError(str(e)) from e


def _sample_prompts(
    args: argparse.Namespace, num_runs: int, per: int, tokenizer: Any
) -> tuple[list[list[Any]], list[Any], str]:
    """`per` prompts for each request of each run and of the warm-up (see _load_workloads).

    Chat and rerank send text; embeddings send text where `tokenizer` decodes, else token ids."""
    from corral_cli.bench import workload

    needs_text = args.endpoint_type in ("chat", "rerank") or (
        args.endpoint_type == "embeddings" and tokenizer is not None
    )
    num_warmup = args.warmup_requests * per
    if args.dataset:
        requests = workload.load_dataset(
            args.dataset,
            args.num_prompts * per,
            args.seed,
            tokenizer,
            args.max_prompt_len,
            args.max_total_len,
        )
        if needs_text:
            requests = workload.as_chat_prompts(requests, tokenizer, args.endpoint_type)
        requests = requests[: len(requests) // per * per]  # whole requests only
        if not requests:
            raise ValueError(f"{args.dataset} holds fewer than the {per} prompts of one request")
        warmup = [requests[i % len(requests)] for i in range(num_warmup)]
        return [requests] * num_runs, warmup, "tokenizer" if tokenizer else "estimated"
    spec = workload.LengthSpec(
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_dist,
        args.random_sigma,
        args.random_min_len,
        args.max_prompt_len,
        args.max_output_len,
    )
    seed = args.seed
    # Variant i for run i; variant num_runs, which no run sends, for the warm-up.
    sizes = [args.num_prompts * per] * num_runs + ([num_warmup] if num_warmup else [])
    if needs_text and tokenizer is None:
        texts = [workload.random_text_prompts(n, spec, seed, variant=i) for i, n in enumerate(sizes)]
        return texts[:num_runs], (texts[num_runs] if num_warmup else []), "estimated"
    ids = workload.allowed_token_ids(tokenizer, args.random_vocab_size)
    as_text = tokenizer if needs_text else None
    runs = [workload.sample_random(n, spec, seed, ids, as_text, variant=i) for i, n in enumerate(sizes)]
    lengths_from = "exact" if as_text is None else "tokenizer"
    return runs[:num_runs], (runs[num_runs] if num_warmup else []), lengths_from


def _check_before_run(args: argparse.Namespace) -> tuple[list[float], dict[str, str]]:
    """The request rates and headers; BenchError for what would fail during or after the run
    (an output path is checked, and its folders created, before the run, not found bad after it)."""
    from corral_cli.bench import images, report
    from corral_cli.bench.arrivals import parse_rates
    from corral_cli.bench.runner import BenchError, is_generation

    if args.max_tokens_cap is not None and args.no_stream:
        raise BenchError("--max-tokens-cap ends streams early: it cannot go with --no-stream")
    if args.random_images and args.endpoint_type != "chat":
        raise BenchError(f"--random-images goes with --endpoint-type chat, not {args.endpoint_type}")
    if args.max_tokens_cap is not None and not is_generation(args.endpoint_type):
        raise BenchError(
            f"--max-tokens-cap caps generated tokens: --endpoint-type {args.endpoint_type} has none"
        )
    try:
        rates = parse_rates(args.request_rate)
        images.parse_size(args.random_image_size)
        headers = request_headers(args.api_key, args.header)
        if args.plot:
            report.check_plot_format(args.plot)
            report.prepare_output_file(args.plot, "--plot")
        if args.result_file:
            report.prepare_output_file(args.result_file, "--result-file")
    except ValueError as e:
        raise BenchError(str(e)) from e
    return rates, headers


async def _bench(args: argparse.Namespace) -> int:
    from corral_cli.bench import report
    from corral_cli.bench.client import RequestSettings
    from corral_cli.bench.runner import RunSettings, is_generation, resolve_model, run_sweep

    rates, headers = _check_before_run(args)
    workloads, warmup, lengths_from = _load_workloads(args, len(rates))
    model = await resolve_model(args.base_url, args.model, headers)
    settings = RequestSettings(
        base_url=args.base_url,
        model=model,
        endpoint_type=args.endpoint_type,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        max_tokens_cap=args.max_tokens_cap,
        headers=headers,
        stream=not args.no_stream and is_generation(args.endpoint_type),
        extra_body={"encoding_format": args.embedding_encoding}
        if args.endpoint_type == "embeddings"
        else None,
    )
    metrics_url = None if args.no_metrics else (args.metrics_url or args.base_url.rstrip("/") + "/metrics")
    runs = [
        (
            RunSettings(
                rate, args.burstiness, args.max_concurrency, args.seed, metrics_url, not args.no_progress
            ),
            w,
        )
        for rate, w in zip(rates, workloads, strict=True)
    ]
    outcomes = await run_sweep(settings, runs, args.request_timeout, warmup, args.max_concurrency)
    summaries = [o.summary for o in outcomes]
    report.print_report(summaries)
    generates = is_generation(args.endpoint_type)
    config = {
        "base_url": args.base_url,
        "model": model,
        "endpoint_type": args.endpoint_type,
        "dataset": args.dataset or "random",
        "num_prompts": len(workloads[0]),
        "warmup_requests": len(warmup),
        "prompt_lengths": lengths_from,
        # Inputs per embeddings request, documents per rerank query; None for generation.
        "embedding_batch_size": None if generates else args.embedding_batch_size,
        "embedding_encoding": args.embedding_encoding if args.endpoint_type == "embeddings" else None,
        "random_input_len": None if args.dataset else args.random_input_len,
        "random_output_len": None if args.dataset or not generates else args.random_output_len,
        "random_range_ratio": None if args.dataset else args.random_range_ratio,
        "random_dist": None if args.dataset else args.random_dist,
        "random_images": args.random_images or None,  # images a chat request carries
        "random_image_size": args.random_image_size if args.random_images else None,
        "ignore_eos": args.ignore_eos,
        "max_tokens_cap": args.max_tokens_cap,
        "stream": settings.stream,
        "seed": args.seed,
    }
    if args.result_file:
        report.write_result_file(args.result_file, config, summaries)
        log.info("wrote %s", args.result_file)
    if args.plot:
        title = f"{model} @ {args.base_url}"
        if len(outcomes) > 1:
            report.plot_sweep(summaries, args.plot, title)
        else:
            rate = report.rate_label(rates[0])
            report.plot_latency_distributions(outcomes[0].results, args.plot, f"{title}, rate {rate}")
        log.info("wrote %s", args.plot)
    if all(s["completed"] == 0 for s in summaries):
        errors: dict[str, int] = next((s["errors"] for s in summaries if s["errors"]), {})
        log.error("every request failed; most common errors: %s", errors)
        return 1
    return 0
