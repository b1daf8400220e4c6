"""The operator's own metrics: every tick counted, failed ones by reason, served over HTTP."""

from __future__ import annotations

import logging
import socket
import urllib.request

import kopf
import pytest
from corral_operator import handlers
from corral_operator.errors import error_reason
from corral_operator.kube import Conflict, Forbidden, Invalid, KubeError, Unavailable
from corral_operator.spec import SpecError
from corral_operator.telemetry import ERROR_REASONS, RECONCILE_ERRORS_TOTAL, RECONCILES_TOTAL, OperatorMetrics
from prometheus_client import generate_latest

from tests.operator.invalid_cases import valid_spec
from tests.operator.test_operator_reconcile import FakeKube, body, make_ctx


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_ticks_and_their_failures_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf, "event", lambda *args, **kwargs: None)  # no kopf event queue here
    kube = FakeKube()
    ctx = make_ctx(kube)
    memo = kopf.Memo(ctx=ctx)
    logger = logging.getLogger("test")
    cr = kopf.Body(body(valid_spec()))  # type: ignore[arg-type]
    handlers.on_change(body=cr, memo=memo, logger=logger)
    kube.reject_kind, kube.reject_error = "Deployment", Unavailable(503, "API server restarting")
    with pytest.raises(kopf.TemporaryError):
        handlers.on_timer(body=cr, memo=memo, logger=logger)
    bad = valid_spec()
    bad["engine"]["args"] = {"blockSize": 3}
    kube.reject_kind = None
    with pytest.raises(kopf.PermanentError):
        handlers.on_change(body=kopf.Body(body(bad)), memo=kopf.Memo(ctx=ctx), logger=logger)  # type: ignore[arg-type]

    m = ctx.telemetry
    assert value(m, RECONCILES_TOTAL) == 3
    assert value(m, RECONCILE_ERRORS_TOTAL, reason="api_unavailable") == 1
    assert value(m, RECONCILE_ERRORS_TOTAL, reason="invalid_spec") == 1
    assert value(m, RECONCILE_ERRORS_TOTAL, reason="conflict") == 0  # zero series from the start


def test_error_reasons_cover_every_kind() -> None:
    cases = {
        "invalid_spec": SpecError("x"),
        "conflict": Conflict(409, "x"),
        "forbidden": Forbidden(403, "x"),
        "rejected": Invalid(422, "x"),
        "api_unavailable": Unavailable(503, "x"),
    }
    for reason, error in cases.items():
        assert error_reason(error) == reason
    assert error_reason(KubeError(500, "x")) == "api_unavailable"
    assert set(cases) | {"apply"} == set(ERROR_REASONS)


def test_metrics_are_served_over_http() -> None:
    metrics = OperatorMetrics()
    metrics.reconciles.inc(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics.serve(port, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert f"{RECONCILES_TOTAL} 2.0" in text
    assert text == generate_latest(metrics.registry).decode()
