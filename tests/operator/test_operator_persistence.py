"""What kopf remembers between events stays in the operator's memory (nothing on the object for
`kubectl describe` to show), and a field a newer CRD defaults is not a user's change."""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
import pytest
from corral_operator import handlers
from corral_operator.handlers import ANNOTATION_PREFIX
from corral_operator.kopf_logs import POSTING_LOGGER, WATCH_LOGGER
from kopf._cogs.clients.errors import APIForbiddenError, APITooManyRequestsError
from kopf._cogs.structs.diffs import diff as kopf_diff  # kopf exports the Diff type, not the function

from tests.operator.invalid_cases import valid_spec
from tests.operator.test_operator_changes import posted  # noqa: F401  # fixture
from tests.operator.test_operator_reconcile import FakeKube, body, make_ctx

LEGACY = f"{ANNOTATION_PREFIX}/last-handled-configuration"


@pytest.fixture
def settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)
    return settings


def _cr(spec: dict[str, Any], generation: int = 1, annotations: dict[str, str] | None = None) -> kopf.Body:
    raw = body(spec, generation=generation)
    raw["metadata"]["annotations"] = dict(annotations or {})
    return kopf.Body(raw)  # type: ignore[arg-type]


def test_the_last_handled_spec_and_handler_progress_are_not_written_on_the_object(
    settings: kopf.OperatorSettings,
) -> None:
    diffbase, progress = settings.persistence.diffbase_storage, settings.persistence.progress_storage
    cr = _cr(valid_spec(), annotations={"corral.dev/wake": "1"})
    patch = kopf.Patch()
    essence = diffbase.build(body=cr)
    diffbase.store(body=cr, patch=patch, essence=essence)
    record: kopf.ProgressRecord = {"retries": 2, "delayed": "2026-01-01T00:00:00", "message": "conflict"}
    progress.store(key=kopf.HandlerId("on_change"), record=record, body=cr, patch=patch)
    assert dict(patch) == {}  # no annotation, no status: describe shows what the user wrote
    assert diffbase.fetch(body=cr) == essence
    assert essence["metadata"]["annotations"] == {"corral.dev/wake": "1"}  # the gateway's wake still counts
    assert progress.fetch(key=kopf.HandlerId("on_change"), body=cr) == record
    progress.purge(key=kopf.HandlerId("on_change"), body=cr, patch=patch)
    assert progress.fetch(key=kopf.HandlerId("on_change"), body=cr) is None and dict(patch) == {}


def test_an_upgraded_operator_reads_the_old_annotation_once_then_removes_it(
    settings: kopf.OperatorSettings,
) -> None:
    diffbase = settings.persistence.diffbase_storage
    marker = f"{ANNOTATION_PREFIX}/kopf-managed"
    touch = f"{ANNOTATION_PREFIX}/touch-dummy"
    cr = _cr(valid_spec(), annotations={LEGACY: '{"spec":{"replicas":1}}\n', marker: "yes", touch: "x"})
    assert diffbase.fetch(body=cr) == {"spec": {"replicas": 1}}  # a change made while it restarted shows
    new = diffbase.build(body=cr)
    assert "annotations" not in new.get("metadata", {})  # kopf's own bookkeeping is no change
    patch = kopf.Patch()
    diffbase.store(body=cr, patch=patch, essence=new)
    assert patch["metadata"]["annotations"] == {LEGACY: None, marker: None, touch: None}


def test_a_deleted_object_is_forgotten(settings: kopf.OperatorSettings) -> None:
    diffbase = settings.persistence.diffbase_storage
    cr = _cr(valid_spec())
    diffbase.store(body=cr, patch=kopf.Patch(), essence=diffbase.build(body=cr))
    deleting = copy.deepcopy(dict(cr))
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert diffbase.fetch(body=kopf.Body(deleting)) is None
    assert diffbase.fetch(body=cr) is None


def test_a_field_a_newer_crd_defaults_posts_no_updated_event(
    settings: kopf.OperatorSettings,
    posted: list[tuple[str, str, str]],  # noqa: F811
) -> None:
    diffbase = settings.persistence.diffbase_storage
    memo = kopf.Memo(ctx=make_ctx(FakeKube()))
    log = logging.getLogger("test")
    handled = diffbase.build(body=_cr(valid_spec()))
    # The API server serves the same generation with a field only the newer CRD knows, defaulted.
    served = diffbase.build(body=_cr({**valid_spec(), "futureField": {"enabled": False}}))
    changes = kopf_diff(handled, served)
    assert [tuple(item[1]) for item in changes] == [("spec", "futureField")]
    handlers.on_update(body=_cr(valid_spec()), memo=memo, logger=log, diff=changes, old=handled)  # type: ignore[arg-type]
    assert [p for p in posted if p[1] in ("Updated", "RollingOut")] == []
    # A user's change (a new generation) still says what changed.
    edited = {**valid_spec(), "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}
    newer = diffbase.build(body=_cr(edited, generation=2))
    changes = kopf_diff(handled, newer)
    handlers.on_update(body=_cr(edited, generation=2), memo=memo, logger=log, diff=changes, old=handled)  # type: ignore[arg-type]
    updated = [p for p in posted if p[1] == "Updated"]
    assert updated == [("Normal", "Updated", "generation 2: autoscaling changed")]


def test_a_throttled_watch_is_a_warning_not_an_error(
    settings: kopf.OperatorSettings, caplog: pytest.LogCaptureFixture
) -> None:
    throttled = APITooManyRequestsError({"message": "storage is (re)initializing"}, status=429, headers={})  # type: ignore[arg-type]
    url = "GET https://127.0.0.1:6443/apis/corral.dev/v1alpha1/llmdeployments?watch=true"
    watch_log = logging.getLogger(WATCH_LOGGER)
    with caplog.at_level(logging.DEBUG, logger=WATCH_LOGGER):
        # What kopf's request retry loop logs for the watch's request (kopf/_cogs/clients/api.py).
        watch_log.error(f"Request attempt #1/9 failed; will retry: {url} -> {throttled!r}")
        watch_log.error(f"Request attempt #1/9 failed; will retry: {url} -> boom")
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]  # other failures stay errors


def test_an_event_into_a_namespace_being_deleted_is_not_an_error(
    settings: kopf.OperatorSettings, caplog: pytest.LogCaptureFixture
) -> None:
    message = (
        'events "corral-x" is forbidden: unable to create new content in namespace ml because it is '
        "being terminated"
    )
    terminating = APIForbiddenError({"message": message, "code": 403}, status=403, headers={})  # type: ignore[arg-type]
    url = "POST https://127.0.0.1:6443/api/v1/namespaces/ml/events"
    posting_log = logging.getLogger(POSTING_LOGGER)
    with caplog.at_level(logging.DEBUG, logger=POSTING_LOGGER):
        # What kopf's request retry loop and its Event poster log (kopf/_cogs/clients/{api,events}.py).
        posting_log.error(f"Request attempt #1/9 failed; will retry: {url} -> {terminating!r}")
        posting_log.error(f"Request attempt #9/9 failed; escalating: {url} -> {terminating!r}")
        posting_log.warning(
            f"Failed to post an event. Ignoring and continuing. Code: 403. Message: {message}."
        )
        posting_log.error(f"Request attempt #1/9 failed; will retry: {url} -> forbidden by RBAC")
    assert [r.levelname for r in caplog.records] == ["DEBUG", "DEBUG", "DEBUG", "ERROR"]


def test_the_finalizer_has_a_corral_name_and_an_older_operators_is_removed(
    settings: kopf.OperatorSettings,
) -> None:
    assert settings.persistence.finalizer == handlers.FINALIZER == "operator.corral.dev/finalizer"
    raw = body(valid_spec())
    raw["metadata"]["finalizers"] = ["example.com/keep", handlers.OLD_FINALIZER]
    raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"  # even one being deleted
    patch = kopf.Patch()
    handlers.drop_old_finalizer(body=kopf.Body(raw), patch=patch)  # type: ignore[arg-type]
    assert patch.as_json_patch(raw) == [{"op": "remove", "path": "/metadata/finalizers/1"}]
    patch = kopf.Patch()
    handlers.drop_old_finalizer(body=kopf.Body(body(valid_spec())), patch=patch)  # type: ignore[arg-type]
    assert not patch
