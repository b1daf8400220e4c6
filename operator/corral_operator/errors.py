"""The one place operator failures become kopf outcomes: retry soon, retry later, or give up."""

from __future__ import annotations

import kopf

from corral_operator.kube import Conflict, Forbidden, Invalid, KubeError, Unavailable
from corral_operator.spec import SpecError
from corral_operator.telemetry import ErrorReason

RETRY_CONFLICT_S = 1.0
RETRY_UNAVAILABLE_S = 5.0
RETRY_FORBIDDEN_S = 60.0  # RBAC may be fixed by an admin; don't hammer the API meanwhile


def to_kopf(error: Exception) -> kopf.TemporaryError | kopf.PermanentError:
    """Map an operator exception to the kopf error that schedules (or stops) the retry."""
    if isinstance(error, SpecError):
        return kopf.PermanentError(f"invalid spec: {error}")
    if isinstance(error, Conflict):
        return kopf.TemporaryError(f"conflict, retrying: {error.message}", delay=RETRY_CONFLICT_S)
    if isinstance(error, Forbidden):
        return kopf.TemporaryError(f"forbidden by RBAC: {error.message}", delay=RETRY_FORBIDDEN_S)
    if isinstance(error, Invalid):
        return kopf.PermanentError(f"rejected by the API server: {error.message}")
    if isinstance(error, Unavailable | KubeError):
        return kopf.TemporaryError(
            f"API server trouble, retrying: {error.message}", delay=RETRY_UNAVAILABLE_S
        )
    return kopf.TemporaryError(f"unexpected {type(error).__name__}: {error}", delay=RETRY_UNAVAILABLE_S)


def error_reason(error: Exception) -> ErrorReason:
    """The `reason` label of corral_operator_reconcile_errors_total for a failed tick."""
    if isinstance(error, SpecError):
        return "invalid_spec"
    if isinstance(error, Conflict):
        return "conflict"
    if isinstance(error, Forbidden):
        return "forbidden"
    if isinstance(error, Invalid):
        return "rejected"
    return "api_unavailable"
