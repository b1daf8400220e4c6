"""From a model URI to a local checkpoint directory. hf:// and s3:// go through the cache: an entry
already complete is returned without any network access; otherwise, under the entry's lock, the
source lists the files, downloads them, the files are verified and the entry is marked complete.
pvc:// reads <pvc_root>/CLAIM/PATH where the claim is mounted; a local path is used where it lies, once
it is seen to be a checkpoint directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from corral_engine.settings import SourceSettings
from corral_engine.sources import cache
from corral_engine.sources.errors import FetchError, disk_error
from corral_engine.sources.progress import Progress
from corral_engine.sources.uri import ModelUri, ModelUriError, parse_model_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FetchOptions:
    """How to fetch: the cache (None: the settings' CORRAL_MODEL_CACHE, else ~/.cache/corral/models),
    an S3 endpoint overriding AWS_ENDPOINT_URL, and whether to report progress."""

    cache_dir: Path | None = None
    s3_endpoint: str | None = None
    show_progress: bool = True


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    uri: ModelUri
    path: Path
    was_downloaded: bool


def parse(text: str, revision: str | None = None) -> ModelUri:
    """A URI (with --revision applied) or a FetchError of kind 'invalid'."""
    try:
        return parse_model_uri(text).with_revision(revision)
    except ModelUriError as e:
        raise FetchError("invalid", str(e)) from e


def resolve_model(
    uri: ModelUri, settings: SourceSettings, options: FetchOptions = FetchOptions()
) -> ResolvedModel:
    """The local directory holding `uri`'s checkpoint, downloading it first if it is remote."""
    if uri.scheme == "local":
        problem = local_model_problem(Path(uri.location))
        if problem is not None:
            raise FetchError("not_found", problem)
        return ResolvedModel(uri, Path(uri.location), was_downloaded=False)
    if uri.scheme == "pvc":
        path = settings.pvc_root / uri.location / uri.path
        cache.verify_checkpoint(path)
        return ResolvedModel(uri, path, was_downloaded=False)
    endpoint = (options.s3_endpoint or settings.aws_endpoint_url) if uri.scheme == "s3" else None
    cache_dir = options.cache_dir or settings.cache_dir
    entry = cache.entry_dir(cache_dir, uri, endpoint)
    if cache.is_complete(entry):
        log.info("%s is in the cache at %s", uri.text, entry)
        return ResolvedModel(uri, entry, was_downloaded=False)
    new_dirs = cache.missing_dirs(entry.parent)  # removed again if the fetch fails
    try:
        with cache.entry_lock(cache_dir, entry):
            if cache.is_complete(entry):  # another process finished it while we waited
                return ResolvedModel(uri, entry, was_downloaded=False)
            try:
                _download(uri, settings, options, entry)
            except BaseException:  # Ctrl-C too: whatever arrived stays for the next try
                cache.discard_failed(entry)
                raise
    except OSError as e:
        full = disk_error(e)
        if full is not None:
            raise full from e
        raise FetchError("error", f"cannot write the cache at {entry}: {e.strerror or e}") from e
    finally:
        cache.remove_empty(new_dirs)  # a complete entry keeps them
    return ResolvedModel(uri, entry, was_downloaded=True)


def local_model_problem(path: Path, marker: str = "config.json") -> str | None:
    """Why the local `path` is no model directory (missing, a file, no `marker` file in it), else None:
    a stat or two, so callers say it before anything loads torch."""
    if path.is_file():
        where = f"give the directory that holds {marker}"
        return f"model path {str(path)!r} is a file, not a checkpoint directory ({where})"
    if not path.is_dir():
        return f"model directory {str(path)!r} does not exist"
    if not (path / marker).is_file():
        return f"model directory {str(path)!r} has no {marker}"
    return None


def _download(uri: ModelUri, settings: SourceSettings, options: FetchOptions, entry: Path) -> None:
    entry.mkdir(parents=True, exist_ok=True)
    if uri.scheme == "hf":
        from corral_engine.sources.hf import HfSource

        hf = HfSource(settings)
        listing = hf.list_files(uri)
        files, commit = listing.files, listing.commit
        log.info("fetching %s (commit %s, %d files) into %s", uri.text, commit[:12], len(files), entry)
        cache.forget_damaged(entry, files)
        with _progress(uri, entry, files, options):
            hf.download(uri, listing, entry)
    else:
        from corral_engine.sources.s3 import S3Source

        s3 = S3Source(settings, options.s3_endpoint)
        files, commit = s3.list_files(uri), None
        log.info("fetching %s (%d files) into %s", uri.text, len(files), entry)
        cache.forget_damaged(entry, files)
        with _progress(uri, entry, files, options):
            s3.download(uri, files, entry)
    cache.verify_files(entry, files)
    cache.mark_complete(entry, uri, commit, files)
    log.info("%s is complete in the cache", uri.text)


def _progress(uri: ModelUri, entry: Path, files: list[cache.ExpectedFile], options: FetchOptions) -> Progress:
    total = sum(f.size_bytes or 0 for f in files)
    return Progress(entry, total, uri.text, enabled=options.show_progress)
