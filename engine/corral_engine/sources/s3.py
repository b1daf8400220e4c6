"""s3:// models through boto3: the objects under the prefix listed (sizes, and MD5 where the ETag is
one), the checkpoint's files downloaded into the cache entry, and S3's errors mapped to fetch errors.
A custom endpoint (AWS_ENDPOINT_URL or --s3-endpoint) serves S3-compatible stores."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from corral_engine.settings import SourceSettings
from corral_engine.sources.cache import ExpectedFile, allow_patterns
from corral_engine.sources.errors import FetchError, disk_error
from corral_engine.sources.uri import ModelUri

_NOT_FOUND = {"404", "NoSuchBucket", "NoSuchKey", "NotFound"}
_UNAUTHORIZED = {
    "401", "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "AllAccessDisabled",
}  # fmt: skip


class S3Source:
    def __init__(self, settings: SourceSettings, endpoint: str | None = None) -> None:
        self.endpoint = endpoint or settings.aws_endpoint_url
        self._settings = settings
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            s = self._settings

            def secret(value: Any) -> str | None:
                return value.get_secret_value() if value is not None else None

            self._client = boto3.session.Session().client(
                "s3",
                endpoint_url=self.endpoint,
                region_name=s.aws_region or "us-east-1",
                aws_access_key_id=secret(s.aws_access_key_id),
                aws_secret_access_key=secret(s.aws_secret_access_key),
                aws_session_token=secret(s.aws_session_token),
                config=Config(retries={"max_attempts": 3, "mode": "standard"}),
            )
        return self._client

    def list_files(self, uri: ModelUri) -> list[ExpectedFile]:
        """The checkpoint's files directly under the prefix (the engine reads one flat directory)."""
        prefix = f"{uri.path}/" if uri.path else ""
        objects = []
        with _mapped(uri):
            pages = (
                self.client()
                .get_paginator("list_objects_v2")
                .paginate(Bucket=uri.location, Prefix=prefix, Delimiter="/")
            )
            for page in pages:
                objects += page.get("Contents", [])
        names = {obj["Key"][len(prefix) :]: obj for obj in objects}
        patterns = allow_patterns(list(names))
        files = []
        for name, obj in names.items():
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                etag = str(obj.get("ETag", "")).strip('"')
                md5 = etag if len(etag) == 32 and "-" not in etag else None  # not multipart
                files.append(ExpectedFile(name, size_bytes=int(obj["Size"]), md5=md5))
        if not files:
            raise FetchError("not_found", f"{uri.text}: no checkpoint files under the prefix (404)")
        return sorted(files, key=lambda f: f.name)

    def download(self, uri: ModelUri, files: list[ExpectedFile], directory: Path) -> None:
        """Each file not already there at its listed size (so a retry resumes file by file)."""
        prefix = f"{uri.path}/" if uri.path else ""
        directory.mkdir(parents=True, exist_ok=True)
        with _mapped(uri):
            for f in files:
                target = directory / f.name
                if target.is_file() and target.stat().st_size == f.size_bytes:
                    continue
                # boto3 writes to a temporary name beside the target and renames it when complete.
                self.client().download_file(uri.location, prefix + f.name, str(target))


@contextlib.contextmanager
def _mapped(uri: ModelUri) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        yield
    except ClientError as e:
        error = e.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _NOT_FOUND or status == 404:
            raise FetchError("not_found", f"{uri.text}: bucket or object not found ({code or 404})") from e
        if code in _UNAUTHORIZED or status in (401, 403):
            raise FetchError("unauthorized", f"{uri.text}: unauthorized ({code or status})") from e
        raise FetchError("error", f"{uri.text}: S3 answered {code or status}") from e
    except NoCredentialsError as e:
        raise FetchError("unauthorized", f"{uri.text}: no S3 credentials (AWS_ACCESS_KEY_ID)") from e
    except BotoCoreError as e:
        raise FetchError("error", f"{uri.text}: {type(e).__name__}") from e
    except OSError as e:
        full = disk_error(e)
        if full is not None:
            raise full from e
        raise
