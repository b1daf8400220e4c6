"""hf:// models through huggingface_hub: the revision resolved to a commit and the file list read from
the Hub's API, `snapshot_download` of the checkpoint's files into the cache entry, and the Hub's
errors mapped to fetch errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HTTPError,  # the base of the HTTP library's errors (httpx's, or httpx2's from huggingface_hub 2)
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects

from corral_engine.settings import SourceSettings
from corral_engine.sources.cache import ExpectedFile, allow_patterns
from corral_engine.sources.errors import FetchError, disk_error
from corral_engine.sources.uri import DEFAULT_HF_REVISION, ModelUri

# Parallel file downloads; a checkpoint is a few large shards and a few small JSON files.
MAX_WORKERS = 4


@dataclass(frozen=True, slots=True)
class HfListing:
    commit: str
    files: list[ExpectedFile]
    patterns: list[str]  # what to download: these files' patterns (cache.allow_patterns)


class HfSource:
    def __init__(self, settings: SourceSettings) -> None:
        self.endpoint = settings.hf_endpoint
        # Handed to the client only; SecretStr keeps it out of reprs and logs.
        self._token = settings.hf_token.get_secret_value() if settings.hf_token else None

    def list_files(self, uri: ModelUri) -> HfListing:
        """The commit the revision points at and the checkpoint's files there, with the sizes the
        Hub lists and the SHA-256 of files stored in LFS."""
        api = HfApi(endpoint=self.endpoint, token=self._token or False)
        with _mapped(uri):
            info = api.model_info(uri.location, revision=uri.revision or DEFAULT_HF_REVISION)
            if info.sha is None:
                raise FetchError("error", f"the Hub gave no commit for {uri.text}")
            entries = {
                f.path: f
                for f in api.list_repo_tree(uri.location, revision=info.sha, recursive=True)
                if isinstance(f, huggingface_hub.hf_api.RepoFile)
            }
        patterns = allow_patterns(list(entries))
        names = list(filter_repo_objects(entries, allow_patterns=patterns))
        files = [_expected(entries[name]) for name in sorted(names)]
        return HfListing(info.sha, files, patterns)

    def download(self, uri: ModelUri, listing: HfListing, directory: Path) -> None:
        """The listed files at the listed commit into `directory` (resumes partial files)."""
        huggingface_hub.utils.disable_progress_bars()  # Progress shows one bar for every source
        with _mapped(uri):
            huggingface_hub.snapshot_download(
                uri.location,
                revision=listing.commit,
                local_dir=directory,
                allow_patterns=listing.patterns,
                endpoint=self.endpoint,
                token=self._token or False,
                max_workers=MAX_WORKERS,
            )


def _expected(entry: huggingface_hub.hf_api.RepoFile) -> ExpectedFile:
    lfs = entry.lfs
    return ExpectedFile(entry.path, size_bytes=entry.size, sha256=lfs.sha256 if lfs is not None else None)


@contextlib.contextmanager
def _mapped(uri: ModelUri) -> Iterator[None]:
    """The Hub's errors as FetchErrors with one-line messages (never the request's headers)."""
    try:
        yield
    except (RevisionNotFoundError, RemoteEntryNotFoundError) as e:
        raise FetchError("not_found", f"{uri.text}: revision or file not found (404)") from e
    except GatedRepoError as e:
        raise FetchError("unauthorized", f"{uri.text} is gated: the token has no access (403)") from e
    except HfHubHTTPError as e:
        raise _from_status(uri, e) from e
    except LocalEntryNotFoundError as e:
        cause = e.__cause__
        if isinstance(cause, HfHubHTTPError):
            raise _from_status(uri, cause) from e
        raise FetchError("error", f"{uri.text}: the Hub cannot be reached") from e
    except OfflineModeIsEnabled as e:
        message = (
            f"{uri.text} is not in the cache and HF_HUB_OFFLINE=1 (the engine images' default) forbids "
            "downloading it: set HF_HUB_OFFLINE=0 where the download may happen"
        )
        raise FetchError("error", message) from e
    except HTTPError as e:  # connection refused, DNS, timeouts
        raise FetchError("error", f"{uri.text}: the Hub cannot be reached ({type(e).__name__})") from e
    except OSError as e:
        full = disk_error(e)
        if full is not None:
            raise full from e
        raise


def _from_status(uri: ModelUri, error: HfHubHTTPError) -> FetchError:
    status = error.response.status_code if error.response is not None else None
    if status in (401, 403):
        # The Hub answers 401 for a repository it will not show this token, existing or not.
        why = "the token was refused" if status == 403 else "no valid token, or a private repository"
        return FetchError("unauthorized", f"{uri.text}: unauthorized ({status}): {why}")
    if status == 404 or isinstance(error, RepositoryNotFoundError):
        return FetchError("not_found", f"{uri.text}: repository not found ({status})")
    return FetchError("error", f"{uri.text}: the Hub answered {status}")
