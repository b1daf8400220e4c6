"""Why a fetch failed, as one of a few kinds, each with its exit code and condition reason; and the
mapping from OS errors (a full disk) into them. Each client's own errors are mapped in its module."""

from __future__ import annotations

import errno
from typing import Literal

Kind = Literal["not_found", "unauthorized", "disk_full", "corrupt", "invalid", "error"]

# kind -> (exit code of `corral fetch-model`, the reason a status condition shows).
KINDS: dict[Kind, tuple[int, str]] = {
    "error": (1, "FetchFailed"),
    "invalid": (2, "InvalidModelURI"),
    "not_found": (3, "ModelNotFound"),
    "unauthorized": (4, "ModelUnauthorized"),
    "disk_full": (5, "DiskFull"),
    "corrupt": (6, "ModelCorrupt"),
}


class FetchError(Exception):
    """A fetch that cannot succeed as asked; the message is one line and carries no secret."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def exit_code(self) -> int:
        return KINDS[self.kind][0]

    @property
    def reason(self) -> str:
        return KINDS[self.kind][1]

    def one_line(self) -> str:
        return f"{self.reason}: {' '.join(str(self).split())}"


def disk_error(error: BaseException) -> FetchError | None:
    """A FetchError for a full disk or quota anywhere in `error`'s chain of causes, else None."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return FetchError("disk_full", f"no space left for the model in the cache ({seen.strerror})")
        seen = seen.__cause__ or seen.__context__
    return None
