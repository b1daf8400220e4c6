"""`corral fetch-model URI`: download a model into the cache (once per cache, under a lock), verify it,
and print its local directory as the last line of stdout. The engine image's init container runs it.

Exit codes: 0 done, 1 other error, 2 bad URI or flags, 3 not found, 4 unauthorized, 5 disk full,
6 files differ from what the source lists. Failures are one line on stderr, with no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from corral_engine.settings import SourceSettings
from corral_engine.sources import KINDS, FetchError, FetchOptions, ResolvedModel, parse, resolve_model
from pydantic import ValidationError

log = logging.getLogger(__name__)

# The clients log every request (and botocore, at DEBUG, its signed headers): our own lines say what
# is fetched, so theirs stay at WARNING whatever --log-level is.
CLIENT_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "httpx", "httpx2", "httpcore", "filelock")


def add_source_arguments(parser: argparse.ArgumentParser, cache_flag: str = "--cache-dir") -> None:
    """The flags `corral engine` shares (its cache flag is --model-cache-dir)."""
    parser.add_argument(
        cache_flag,
        dest="model_cache_dir",
        metavar="DIR",
        help="the model cache for hf:// and s3:// models "
        "(default: $CORRAL_MODEL_CACHE, else ~/.cache/corral/models)",
    )
    parser.add_argument(
        "--s3-endpoint",
        metavar="URL",
        help="an S3-compatible store's address (default: $AWS_ENDPOINT_URL, else AWS)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "uri",
        metavar="URI",
        help="hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX, pvc://CLAIM/PATH, or a directory (checked: "
        "it exists and holds config.json)",
    )
    parser.add_argument("--revision", help="the Hub revision: a branch, tag or commit (hf:// only)")
    add_source_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress reports")
    parser.epilog = "exit codes: " + ", ".join(f"{code} {reason}" for code, reason in sorted(KINDS.values()))


def fetch(
    text: str,
    *,
    cache_dir: str | None = None,
    s3_endpoint: str | None = None,
    revision: str | None = None,
    show_progress: bool = True,
) -> ResolvedModel:
    """The model URI `text` resolved to a local directory (what `corral engine` and `up` call too)."""
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        settings = SourceSettings()  # the cache and the credentials, read here once
    except ValidationError as e:
        # The variables' names only: pydantic's message quotes the values.
        names = ", ".join(sorted({str(error["loc"][0]) for error in e.errors() if error["loc"]}))
        raise FetchError("invalid", f"invalid model source setting in the environment: {names}") from e
    uri = parse(text, revision)
    cache = Path(cache_dir).expanduser() if cache_dir else None
    options = FetchOptions(cache_dir=cache, s3_endpoint=s3_endpoint, show_progress=show_progress)
    return resolve_model(uri, settings, options)


def run(args: argparse.Namespace) -> int:
    try:
        resolved = fetch(
            args.uri,
            cache_dir=args.model_cache_dir,
            s3_endpoint=args.s3_endpoint,
            revision=args.revision,
            show_progress=not args.quiet,
        )
    except FetchError as e:
        log.error("%s", e.one_line())
        return e.exit_code
    sys.stdout.write(f"{resolved.path}\n")
    return 0
