"""The model cache: one directory per source and revision, a lock so that processes sharing the cache
(replicas on one PVC) download an entry once, a marker written atomically when the entry is complete,
what a failed download leaves, and the check that a directory holds a loadable checkpoint."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from corral_engine import lora
from corral_engine.sources.errors import FetchError
from corral_engine.sources.uri import ModelUri, cache_subdir
from corral_engine.weight_files import (
    ADAPTER_SAFETENSORS,
    INDEXES,
    adapter_weights,
    weight_format,
    weight_patterns,
)

log = logging.getLogger(__name__)

COMPLETE_MARKER = ".corral-complete.json"
LOCK_SUFFIX = ".lock"
LOCKS_DIR = ".locks"  # under the cache directory
# Files a checkpoint may have that the engine reads besides its weights; sources download only
# these and the weights `weight_files.weight_pattern` picks (safetensors, else PyTorch pickles).
ALLOW_PATTERNS = (
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# huggingface_hub's bookkeeping inside a download directory; its partial files there end in .incomplete.
CLIENT_STATE_DIR = ".cache"
PARTIAL_SUFFIX = ".incomplete"


@dataclass(frozen=True, slots=True)
class ExpectedFile:
    """A file the source lists, with what the source says about it (None where it says nothing)."""

    name: str
    size_bytes: int | None = None
    sha256: str | None = None
    md5: str | None = None


def entry_dir(cache_dir: Path, uri: ModelUri, endpoint: str | None = None) -> Path:
    """Where `uri` lives in the cache (uri.cache_subdir says how)."""
    return cache_dir / cache_subdir(uri, endpoint)


def is_complete(entry: Path) -> bool:
    """The marker is there and every file it lists still has its size (a stat each, no reading: a
    file deleted or truncated since makes the entry incomplete, and the next fetch repairs it)."""
    try:
        listed = json.loads((entry / COMPLETE_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, size in listed.items():
        path = entry / name
        if not path.is_file() or (size is not None and path.stat().st_size != size):
            log.warning("%s in the cache lost %s since it was fetched; fetching again", entry, name)
            return False
    return True


def mark_complete(entry: Path, uri: ModelUri, commit: str | None, files: list[ExpectedFile]) -> None:
    """Write the marker through a temporary file and a rename, so a reader sees all of it or none."""
    record = {
        "uri": uri.text,
        "commit": commit,
        "files": {f.name: f.size_bytes for f in files},
        "completed_at": time.time(),
    }
    tmp = entry / f"{COMPLETE_MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, entry / COMPLETE_MARKER)


@contextlib.contextmanager
def entry_lock(cache_dir: Path, entry: Path) -> Iterator[None]:
    """Hold the entry's lock: an fcntl lock (local disks and NFS v4 honour it) on a file under the
    cache's `.locks/`, as huggingface_hub keeps its own, so the model tree holds checkpoints only
    and a failed fetch leaves no lock beside them. Lock files stay: deleting one a waiter has open
    would let two processes hold "the" lock."""
    name = entry.relative_to(cache_dir).as_posix().replace("/", "--") + LOCK_SUFFIX
    (cache_dir / LOCKS_DIR).mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache_dir / LOCKS_DIR / name))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is fetching %s; waiting for it", entry)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def missing_dirs(directory: Path) -> list[Path]:
    """`directory` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def remove_empty(directories: list[Path]) -> None:
    """rmdir each of `directories` (deepest first) that is empty; one that is not stays."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def discard_failed(entry: Path) -> None:
    """After a failed download: an entry holding checkpoint bytes stays, for the next try to resume
    it; one holding none (the listing failed, or nothing arrived) is removed with the clients'
    bookkeeping, so the cache is as the fetch found it."""
    if has_downloaded_bytes(entry):
        log.info("the partial download stays in %s; the next fetch resumes it", entry)
    else:
        shutil.rmtree(entry, ignore_errors=True)


def has_downloaded_bytes(entry: Path) -> bool:
    """Any checkpoint bytes in `entry`: whole files, boto3's temporary ones beside them, or
    huggingface_hub's partial files (under its state directory, next to its metadata)."""
    for path in entry.rglob("*"):
        is_client_state = CLIENT_STATE_DIR in path.relative_to(entry).parts
        if is_client_state and path.suffix != PARTIAL_SUFFIX:
            continue
        with contextlib.suppress(OSError):  # removed while we looked
            if path.is_file() and path.stat().st_size > 0:
                return True
    return False


def forget_damaged(directory: Path, expected: list[ExpectedFile]) -> None:
    """Before a download: drop the marker and every file whose size differs from the listing, so the
    clients (which skip a file they once finished) fetch those again."""
    (directory / COMPLETE_MARKER).unlink(missing_ok=True)
    for f in expected:
        path = directory / f.name
        if f.size_bytes is not None and path.is_file() and path.stat().st_size != f.size_bytes:
            path.unlink()


def verify_files(directory: Path, expected: list[ExpectedFile]) -> None:
    """Every listed file is there with the listed size and digest, and the directory is a checkpoint.
    A file that fails is deleted, so that the next try downloads it again."""
    for f in expected:
        path = directory / f.name
        if not path.is_file():
            raise FetchError("corrupt", f"{f.name} is missing after the download")
        size = path.stat().st_size
        problem = None
        if f.size_bytes is not None and size != f.size_bytes:
            problem = f"{f.name} has {size} bytes, the source lists {f.size_bytes}"
        for algorithm, want in (("sha256", f.sha256), ("md5", f.md5)):
            if problem is None and want is not None and _digest(path, algorithm) != want:
                problem = f"{f.name}'s {algorithm} differs from the source's"
        if problem is not None:
            path.unlink()
            raise FetchError("corrupt", problem)
    verify_checkpoint(directory)


def allow_patterns(names: list[str]) -> list[str]:
    """What to download of a listing of file `names`: the files the engine reads and the weights
    in one format (safetensors where there are any, else `pytorch_model*.bin`)."""
    return [*ALLOW_PATTERNS, *weight_patterns(names)]


def verify_checkpoint(directory: Path) -> None:
    """A config, weights in safetensors or PyTorch pickles (every shard an index names) and a
    tokenizer; or a LoRA adapter in PEFT's layout (its config and weights: no tokenizer of its own)."""
    if not directory.is_dir():
        raise FetchError("not_found", f"{directory} is not a directory")
    if (directory / lora.CONFIG_FILE).is_file():
        if adapter_weights(p.name for p in directory.iterdir()) is None:
            raise FetchError(
                "not_found", f"{directory} is not a complete LoRA adapter: no {ADAPTER_SAFETENSORS}"
            )
        return
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    kind = weight_format(p.name for p in directory.iterdir())
    if kind is None:
        missing.append("*.safetensors (or pytorch_model*.bin)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    index = directory / INDEXES[kind or "safetensors"]
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing += sorted(s for s in shards if not (directory / s).is_file())
    if missing:
        raise FetchError("not_found", f"{directory} is not a complete checkpoint: no {', '.join(missing)}")


def _digest(path: Path, algorithm: str) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, algorithm).hexdigest()
